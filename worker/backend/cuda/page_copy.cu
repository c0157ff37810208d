// Page gather/scatter kernel (see page_copy.h).
#include <cuda_runtime.h>

#include "worker/backend/cuda/cuda_check.h"
#include "worker/backend/cuda/page_copy.h"

namespace kvcache::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;  // 16-byte loads in flight per thread
constexpr int64_t kPieceVecs =
    int64_t{kThreads} * kUnroll * 4;  // 64 KiB: one block's share of a page per step

// Work item w = (page w / pieces, piece w % pieces); blocks stride over items.
// Loads are issued kUnroll at a time before the stores, so each SM keeps many
// PCIe reads outstanding when the source is host memory.
static __global__ void __launch_bounds__(kThreads)
    CopyPagesKernelImpl(const PageCopyOp* ops, int n, int64_t page_vecs) {
  const int64_t pieces = (page_vecs + kPieceVecs - 1) / kPieceVecs;
  const int64_t items = pieces * n;
  for (int64_t w = blockIdx.x; w < items; w += gridDim.x) {
    const int64_t page = w / pieces, piece = w % pieces;
    const uint4* src = static_cast<const uint4*>(ops[page].src);
    uint4* dst = static_cast<uint4*>(ops[page].dst);
    const int64_t begin = piece * kPieceVecs;
    const int64_t end = begin + kPieceVecs < page_vecs ? begin + kPieceVecs : page_vecs;
    for (int64_t i = begin + threadIdx.x; i < end; i += int64_t{kThreads} * kUnroll) {
      uint4 r[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t at = i + int64_t{u} * kThreads;
        if (at < end) r[u] = __ldcs(src + at);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t at = i + int64_t{u} * kThreads;
        if (at < end) __stcs(dst + at, r[u]);
      }
    }
  }
}

}  // namespace

bool PageCopyKernelSupports(int64_t page_bytes, const void* src_base, const void* dst_base) {
  return page_bytes > 0 && page_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(src_base) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(dst_base) % 16 == 0;
}

absl::Status LoadPageCopyKernel() {
  cudaFuncAttributes attr{};
  return CudaStatus(cudaFuncGetAttributes(&attr, CopyPagesKernelImpl), "load CopyPagesKernel");
}

absl::Status CopyPagesKernel(const PageCopyOp* ops, int n, int64_t page_bytes, int max_blocks,
                             cudaStream_t stream) {
  if (n <= 0) return absl::OkStatus();
  const int64_t page_vecs = page_bytes / 16;
  const int64_t items = (page_vecs + kPieceVecs - 1) / kPieceVecs * n;
  const int64_t blocks = items < max_blocks ? items : max_blocks;
  CopyPagesKernelImpl<<<static_cast<unsigned>(blocks > 0 ? blocks : 1), kThreads, 0, stream>>>(ops, n,
                                                                                               page_vecs);
  return LastLaunchStatus("CopyPagesKernel");
}

}  // namespace kvcache::cuda
