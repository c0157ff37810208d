// KV tiers of the CUDA backend behind kv::TierStorage:
//
//   tier 0  kDevice      one cudaMalloc slab [n_pages][page_bytes] (no managed memory)
//   tier 1  kPinnedHost  one cudaHostAlloc slab, host-addressable (PageData works)
//
// CopyPages moves pages between any two of: this backend's storages, host-addressable
// storages (the CPU tier). Host<->host copies are memmove. Copies that involve the
// device run on the copy stream, by one of (CopyPath):
//   kKernel   one launch of a gather/scatter kernel over the whole batch, reading
//             and writing the pinned slab through its device mapping (zero-copy):
//             no per-page set-up, so scattered ids cost what contiguous ones do;
//             only between this backend's device and pinned storages
//   kBatched  one cudaMemcpyBatchAsync of the runs of consecutive ids
//   kMemcpy   one cudaMemcpyAsync per run of consecutive ids (each has a few
//             microseconds of copy-engine set-up: H200, 360 KiB pages in shuffled
//             order, ~0.70 of one large pinned cudaMemcpyAsync)
// H200, 360 KiB SmolLM2 pages in shuffled order, 64 MiB batches, against one large
// pinned cudaMemcpyAsync (55 GB/s): kKernel 0.93 offload / 0.90 restore, kBatched
// 0.87, kMemcpy 0.70 (gpu_bench). kAuto (the default) takes kKernel where it
// applies, else kMemcpy. The copy stream
// first waits for the compute stream, and CopyPages returns only once its copies
// completed: a page in flight is never read or freed.
//
// Checksums are XXH3-64 computed on the host (the same function as the CPU tier):
// a pinned page is hashed in place; a device page is copied to a pinned staging
// page first. A device page just restored from host memory (CopyPages from a
// host-addressable source) reports the hash of the host bytes it was restored from,
// so restore verification (KvCacheManager::Restore compares it with the hash taken
// at offload) checks the tier-1 copy without reading the page back; that record is
// consumed by the first Checksum and dropped when the page is written again.
//
// Thread-safety: as kv::TierStorage (the KV cache manager serialises writes and
// copies); Checksum and ReadPage may run concurrently (staging is locked).
#ifndef KVCACHE_WORKER_BACKEND_CUDA_CUDA_TIER_STORAGE_H_
#define KVCACHE_WORKER_BACKEND_CUDA_CUDA_TIER_STORAGE_H_

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "worker/kv/tier_storage.h"

namespace kvcache::cuda {

class DeviceContext;

enum class TierMemory { kDevice, kPinnedHost };
enum class CopyPath { kAuto, kKernel, kBatched, kMemcpy };

class CudaTierStorage : public kv::TierStorage {
 public:
  // Allocates and zero-fills the slab. RESOURCE_EXHAUSTED naming `budget_flag`
  // (e.g. "--tier0_bytes") when the device or pinned memory is too small.
  static absl::StatusOr<std::unique_ptr<CudaTierStorage>> Create(std::shared_ptr<const DeviceContext> ctx,
                                                                 TierMemory memory, int64_t n_pages,
                                                                 int64_t page_bytes,
                                                                 absl::string_view budget_flag);

  // Device copies have microseconds of set-up each: move sessions in large batches.
  int64_t copy_batch_bytes() const override { return int64_t{64} << 20; }

  virtual TierMemory memory() const = 0;
  // How CopyPages into this storage moves device bytes (see above); a path that
  // does not apply to a batch falls back to kMemcpy. For benchmarks and tests;
  // REQUIRES: no CopyPages into this storage in flight.
  virtual void set_copy_path(CopyPath path) = 0;
  // Base of the slab: a device pointer for kDevice, a host pointer for kPinnedHost.
  virtual void* slab() const = 0;
  virtual const DeviceContext& context() const = 0;
  // Forgets which device pages were restored from host memory, so the next
  // Checksum of each reads the device copy. Always safe; the runner calls it
  // before kernels write pages.
  virtual void DropRestoreRecords() = 0;
};

}  // namespace kvcache::cuda

#endif  // KVCACHE_WORKER_BACKEND_CUDA_CUDA_TIER_STORAGE_H_
