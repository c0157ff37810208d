// Backend-neutral storage of one KV tier: a fixed slab of pages.
//
//   slab: [n_pages][page_bytes]   (page layout: see kv_shape.h)
//
// The CPU implementation lives in cpu_tier_storage.cc; the CUDA backend provides
// device memory (tier 0) and pinned host memory (tier 1) behind the same interface.
// Callers (the KV cache manager) depend only on this class. Storage knows nothing
// about which pages are in use: that metadata lives in PagePool.
//
// Thread-safety: not internally synchronised. Concurrent reads of different pages
// are safe; the caller (KvCacheManager) serialises writes and copies.
#ifndef KVCACHE_WORKER_KV_TIER_STORAGE_H_
#define KVCACHE_WORKER_KV_TIER_STORAGE_H_

#include <cstdint>
#include <functional>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace kvcache::kv {

// Tier-local page index. Page metadata is ids, never pointers.
using PageId = int32_t;
inline constexpr PageId kNoPage = -1;

// XXH3-64 of a page's bytes.
using PageChecksum = uint64_t;

class TierStorage {
 public:
  virtual ~TierStorage() = default;

  virtual int64_t num_pages() const = 0;
  virtual int64_t page_bytes() const = 0;
  // Bytes of pages the cache should hand to one CopyPages call when it moves a
  // session between tiers: small enough that a CPU copy checksums cache-warm
  // data, large enough that a device copy amortises its set-up.
  virtual int64_t copy_batch_bytes() const { return int64_t{1} << 20; }

  // Copies src page src_ids[i] onto this storage's page dst_ids[i], for every i, as
  // one batch (contiguous runs are coalesced). `src` may be this storage.
  // REQUIRES: src.page_bytes() == page_bytes(); the two id lists have equal length,
  // all ids in range; no dst page appears twice or also as a src page of this storage.
  // Returns INVALID_ARGUMENT on a violated requirement, UNIMPLEMENTED when this backend
  // cannot read `src`'s memory.
  virtual absl::Status CopyPages(const TierStorage& src, absl::Span<const PageId> src_ids,
                                 absl::Span<const PageId> dst_ids) = 0;

  // Copies dst.size() bytes of page `id` starting at byte `offset` into host memory.
  // REQUIRES: 0 <= offset, offset + dst.size() <= page_bytes().
  virtual absl::Status ReadPage(PageId id, int64_t offset, absl::Span<uint8_t> dst) const = 0;
  // Copies host bytes into page `id` starting at byte `offset`.
  // REQUIRES: 0 <= offset, offset + src.size() <= page_bytes().
  virtual absl::Status WritePage(PageId id, int64_t offset, absl::Span<const uint8_t> src) = 0;

  // XXH3-64 of the page's page_bytes() bytes.
  virtual absl::StatusOr<PageChecksum> Checksum(PageId id) const = 0;

  // Host-addressable bytes of page `id` (page_bytes() long), or nullptr when the
  // memory is not host-addressable (device memory) or `id` is out of range.
  virtual uint8_t* PageData(PageId id) = 0;
  virtual const uint8_t* PageData(PageId id) const = 0;
};

using TierStoragePtr = std::unique_ptr<TierStorage>;

// Creates a tier of `n_pages` host pages, zero-filled (so every page is faulted in
// once at start-up, not on the first offload), 64-byte aligned.
// REQUIRES: n_pages >= 0, page_bytes > 0. RESOURCE_EXHAUSTED when allocation fails.
absl::StatusOr<TierStoragePtr> CreateCpuTierStorage(int64_t n_pages, int64_t page_bytes);

// Makes the storage for tier `tier` (0 or 1). Lets a backend inject its own storage.
using TierStorageFactory =
    std::function<absl::StatusOr<TierStoragePtr>(int tier, int64_t n_pages, int64_t page_bytes)>;

}  // namespace kvcache::kv

#endif  // KVCACHE_WORKER_KV_TIER_STORAGE_H_
