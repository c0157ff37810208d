#include "worker/kv/page_pool.h"

#include <cassert>

#include "absl/strings/str_cat.h"

namespace kvcache::kv {

PagePool::PagePool(TierStoragePtr storage)
    : storage_(std::move(storage)), meta_(static_cast<size_t>(storage_->num_pages())) {
  free_.reserve(meta_.size());
  // Push in reverse so that the first allocations return ids 0, 1, 2, ...
  for (PageId id = static_cast<PageId>(meta_.size()) - 1; id >= 0; --id) free_.push_back(id);
}

PageId PagePool::Allocate(bool staging) {
  if (free_.empty()) return kNoPage;
  const PageId id = free_.back();
  free_.pop_back();
  Meta& m = meta_[id];
  assert(m.on_free_list && m.ref == 0 && !m.cached);
  m.on_free_list = false;
  m.staging = staging;
  m.ref = staging ? 0 : 1;
  return id;
}

void PagePool::CommitStaging(PageId id) {
  assert(meta_[id].staging);
  meta_[id].staging = false;
  meta_[id].ref = 1;
}

void PagePool::FreeStaging(PageId id) {
  assert(meta_[id].staging);
  meta_[id].staging = false;
  PushFree(id);
}

void PagePool::IncRef(PageId id) {
  Meta& m = meta_[id];
  assert(!m.on_free_list && !m.staging);
  if (m.ref == 0) {
    assert(m.on_lru);
    LruRemove(id);
  }
  ++m.ref;
}

void PagePool::DecRef(PageId id) {
  Meta& m = meta_[id];
  assert(m.ref >= 1);
  if (--m.ref == 0) Release(id);
}

void PagePool::SetCached(PageId id, bool cached) {
  Meta& m = meta_[id];
  if (m.cached == cached) return;
  m.cached = cached;
  if (m.ref == 0 && !m.staging) {
    if (cached) {  // cannot happen for a free page: only in-use pages get cached
      assert(false && "caching an unreferenced page");
    } else {
      LruRemove(id);
      PushFree(id);
    }
  }
}

void PagePool::Release(PageId id) {
  if (meta_[id].cached) {
    LruPush(id);
  } else {
    PushFree(id);
  }
}

void PagePool::PushFree(PageId id) {
  Meta& m = meta_[id];
  assert(!m.on_free_list && !m.on_lru);
  m.on_free_list = true;
  m.ref = 0;
  free_.push_back(id);
}

void PagePool::LruPush(PageId id) {
  Meta& m = meta_[id];
  m.on_lru = true;
  m.lru_prev = lru_tail_;
  m.lru_next = kNoPage;
  if (lru_tail_ != kNoPage) meta_[lru_tail_].lru_next = id;
  lru_tail_ = id;
  if (lru_head_ == kNoPage) lru_head_ = id;
  ++num_evictable_;
}

void PagePool::LruRemove(PageId id) {
  Meta& m = meta_[id];
  assert(m.on_lru);
  if (m.lru_prev != kNoPage)
    meta_[m.lru_prev].lru_next = m.lru_next;
  else
    lru_head_ = m.lru_next;
  if (m.lru_next != kNoPage)
    meta_[m.lru_next].lru_prev = m.lru_prev;
  else
    lru_tail_ = m.lru_prev;
  m.on_lru = false;
  m.lru_prev = m.lru_next = kNoPage;
  --num_evictable_;
}

absl::Status PagePool::CheckConsistency() const {
  std::vector<char> seen(meta_.size(), 0);
  for (PageId id : free_) {
    if (!Valid(id) || seen[id]) return absl::InternalError(absl::StrCat("free list: page ", id));
    seen[id] = 1;
    const Meta& m = meta_[id];
    if (!m.on_free_list || m.ref != 0 || m.cached || m.staging || m.on_lru) {
      return absl::InternalError(absl::StrCat("free page ", id, " in a used state"));
    }
  }
  int64_t lru = 0;
  for (PageId id = lru_head_, prev = kNoPage; id != kNoPage; prev = id, id = meta_[id].lru_next) {
    const Meta& m = meta_[id];
    if (!m.on_lru || m.ref != 0 || !m.cached || m.on_free_list || m.lru_prev != prev) {
      return absl::InternalError(absl::StrCat("LRU list: page ", id, " not evictable"));
    }
    if (++lru > capacity()) return absl::InternalError("LRU list has a cycle");
  }
  if (lru != num_evictable_) return absl::InternalError("LRU length mismatch");
  for (PageId id = 0; id < capacity(); ++id) {
    const Meta& m = meta_[id];
    if (m.on_free_list != static_cast<bool>(seen[id])) {
      return absl::InternalError(absl::StrCat("page ", id, " free flag disagrees with list"));
    }
    const bool evictable = !m.on_free_list && !m.staging && m.ref == 0;
    if (evictable != m.on_lru || (evictable && !m.cached)) {
      return absl::InternalError(absl::StrCat("page ", id, " unreferenced but not evictable"));
    }
    if (m.staging && (m.ref != 0 || m.cached)) {
      return absl::InternalError(absl::StrCat("staging page ", id, " is referenced"));
    }
  }
  return absl::OkStatus();
}

}  // namespace kvcache::kv
