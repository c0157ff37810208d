// Page gather/scatter kernel of the CUDA tiers: moves many scattered pages in one
// launch, reading and writing through device-visible pointers. With a pinned
// host slab mapped into the device's address space (zero-copy) one side may be
// host memory: the SMs then drive the PCIe transfer themselves, without the
// microseconds of copy-engine set-up that one cudaMemcpyAsync per page costs.
//
//   pages: [n] {src, dst} device-visible pointers (e.g. in mapped pinned memory)
//
// Host-only header: no CUDA include.
//
// Thread-safety: the launcher is reentrant; ordering is the stream's.
#ifndef KVCACHE_WORKER_BACKEND_CUDA_PAGE_COPY_H_
#define KVCACHE_WORKER_BACKEND_CUDA_PAGE_COPY_H_

#include <cstdint>

#include "absl/status/status.h"
#include "worker/backend/cuda/stream.h"

namespace kvcache::cuda {

struct PageCopyOp {
  const void* src = nullptr;
  void* dst = nullptr;
};

// True when CopyPagesKernel can move pages of `page_bytes` between these bases:
// 16-byte aligned pages (every page_bytes multiple of 16).
bool PageCopyKernelSupports(int64_t page_bytes, const void* src_base, const void* dst_base);

// Copies page_bytes from ops[i].src to ops[i].dst for every i < n, in one launch
// of at most max_blocks blocks. REQUIRES: PageCopyKernelSupports; `ops` is
// device-visible and stays unchanged until the stream passes the kernel; the
// pages do not overlap.
// Loads the kernel's module on the current device (cudaFuncGetAttributes).
absl::Status LoadPageCopyKernel();

absl::Status CopyPagesKernel(const PageCopyOp* ops, int n, int64_t page_bytes, int max_blocks,
                             cudaStream_t stream);

}  // namespace kvcache::cuda

#endif  // KVCACHE_WORKER_BACKEND_CUDA_PAGE_COPY_H_
