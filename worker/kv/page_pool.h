// Page metadata of one tier: free list, reference counts, prefix-cache flag and the
// LRU list of evictable pages. Bytes live in the tier's TierStorage, owned here.
//
// A page is in exactly one state:
//   free        ref == 0, not cached, not staging      (on the free list)
//   in use      ref >= 1                               (referenced by sessions)
//   evictable   ref == 0, cached                       (prefix page nobody uses; LRU list)
//   staging     reserved by an import in flight        (not visible to sessions)
//
// Thread-safety: not synchronised; KvCacheManager guards it with its mutex.
#ifndef KVCACHE_WORKER_KV_PAGE_POOL_H_
#define KVCACHE_WORKER_KV_PAGE_POOL_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "worker/kv/tier_storage.h"

namespace kvcache::kv {

class PagePool {
 public:
  // REQUIRES: storage != nullptr.
  explicit PagePool(TierStoragePtr storage);

  int64_t capacity() const { return static_cast<int64_t>(meta_.size()); }
  int64_t num_free() const { return static_cast<int64_t>(free_.size()); }
  int64_t num_evictable() const { return num_evictable_; }
  TierStorage& storage() { return *storage_; }
  const TierStorage& storage() const { return *storage_; }

  // Takes a free page, with ref = 1 (or staging when `staging`); kNoPage if none free.
  PageId Allocate(bool staging = false);
  // Turns a staging page into an in-use page with ref = 1.
  // REQUIRES: IsStaging(id).
  void CommitStaging(PageId id);
  // Returns a staging page to the free list.
  // REQUIRES: IsStaging(id).
  void FreeStaging(PageId id);

  // REQUIRES: ref(id) >= 1, or the page is evictable (which makes it in use again).
  void IncRef(PageId id);
  // Drops one reference; at zero the page becomes evictable when cached, else free.
  // REQUIRES: ref(id) >= 1.
  void DecRef(PageId id);

  // Marks a page as held by the prefix cache (or not). Uncaching an unreferenced
  // page frees it.
  void SetCached(PageId id, bool cached);
  // Least recently released evictable page, or kNoPage.
  PageId OldestEvictable() const { return lru_head_; }

  int32_t ref(PageId id) const { return meta_[id].ref; }
  bool cached(PageId id) const { return meta_[id].cached; }
  bool IsStaging(PageId id) const { return meta_[id].staging; }
  bool IsFree(PageId id) const { return meta_[id].on_free_list; }
  bool Valid(PageId id) const { return id >= 0 && id < capacity(); }

  // Checks the free list, LRU list and states agree. Reference counts are checked by
  // the manager, which knows the referrers.
  absl::Status CheckConsistency() const;

 private:
  struct Meta {
    int32_t ref = 0;
    bool cached = false;
    bool staging = false;
    bool on_free_list = true;
    bool on_lru = false;
    PageId lru_prev = kNoPage;
    PageId lru_next = kNoPage;
  };
  void LruPush(PageId id);  // to the tail (most recent)
  void LruRemove(PageId id);
  void PushFree(PageId id);
  void Release(PageId id);  // ref reached 0: evictable or free

  TierStoragePtr storage_;
  std::vector<Meta> meta_;
  std::vector<PageId> free_;  // LIFO: recently freed pages are cache-warm
  PageId lru_head_ = kNoPage;
  PageId lru_tail_ = kNoPage;
  int64_t num_evictable_ = 0;
};

}  // namespace kvcache::kv

#endif  // KVCACHE_WORKER_KV_PAGE_POOL_H_
