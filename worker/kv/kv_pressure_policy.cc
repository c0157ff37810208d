// KvCacheManager: the pressure policy (the numbered steps of kv_cache_manager.h):
// making tier-0 room, dropping tier-1 pages, offload and restore.
#include <algorithm>
#include <cassert>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/kv/kv_cache_manager.h"
#include "worker/kv/session_key.h"

namespace kvcache::kv {

absl::Status KvCacheManager::MakeRoom(int64_t n, const Session* protect,
                                      std::vector<std::string>* preempted) {
  if (pool_[0].num_free() >= n) return absl::OkStatus();  // step 1
  if (n > pool_[0].capacity()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("need ", n, " pages, tier 0 holds only ", pool_[0].capacity()));
  }
  std::vector<BlockHash> evicted;
  absl::Status status;
  while (pool_[0].num_free() < n) {
    // Step 2: unreferenced cached prefix pages, least recently released first.
    const PageId e = pool_[0].OldestEvictable();
    if (e != kNoPage) {
      evicted.push_back(page_hash_[e]);
      prefix_index_.erase(page_hash_[e]);
      pool_[0].SetCached(e, false);
      ++counters_.prefix_pages_evicted;
      continue;
    }
    // Steps 3-4: the least recently used idle session; step 5: a running one.
    // One whose tier-0 pages all have other holders (forks, prefix hits)
    // frees nothing when it goes, so it waits until no other can go: offloaded
    // first it would only copy shared pages to tier 1.
    Session* victim = nullptr;
    Session* frees_nothing = nullptr;          // the least recently used of those
    absl::flat_hash_set<const Session*> kept;  // those seen (each move may change what frees)
    for (const bool running : {false, true}) {
      if (running && preempted == nullptr) break;
      while (victim == nullptr) {
        Session* lru = nullptr;
        for (auto& [id, sp] : sessions_) {
          Session& s = *sp;
          const int64_t tier0 = static_cast<int64_t>(s.pages.size()) - s.first_live - s.tier1_pages;
          if (&s == protect || Pinned(s) || s.running != running || tier0 == 0 || kept.contains(&s)) continue;
          if (lru == nullptr || s.last_use < lru->last_use) lru = &s;
        }
        if (lru == nullptr) break;
        if (FreesTier0Page(*lru)) {
          victim = lru;
        } else {
          kept.insert(lru);
          if (frees_nothing == nullptr) frees_nothing = lru;
        }
      }
      if (victim != nullptr) break;
    }
    if (victim == nullptr) victim = frees_nothing;
    if (victim == nullptr) break;
    const bool preempt = victim->running;
    absl::StatusOr<int64_t> moved = OffloadLocked(*victim, /*allow_drop=*/true);
    if (!moved.ok()) {
      status = moved.status();
      break;
    }
    if (preempt) {
      victim->running = false;
      ++counters_.preemptions;
      preempted->push_back(victim->id);
    }
  }
  EmitPrefixLocked(KvEventType::kPrefixRemoved, 0, std::move(evicted));
  KVCACHE_RETURN_IF_ERROR(status);
  if (pool_[0].num_free() < n) {
    return absl::ResourceExhaustedError(
        absl::StrCat("need ", n, " free tier-0 pages, only ", pool_[0].num_free(),
                     " could be made free (the rest are pinned or in a step)"));
  }
  return absl::OkStatus();
}

absl::flat_hash_set<PageId> KvCacheManager::HeldTier0PagesLocked() const {
  absl::flat_hash_set<PageId> held;
  for (const auto& [id, s] : sessions_) {
    if (!StaysInTier0(*s)) continue;
    for (size_t i = s->first_live; i < s->pages.size(); ++i) {
      if (s->pages[i].tier == 0) held.insert(s->pages[i].id);
    }
  }
  return held;
}

int64_t KvCacheManager::Tier0PagesFreeable() const {
  absl::MutexLock l(&mu_);
  // A page goes once every session holding it has (a fork's, a prefix hit's):
  // those of the other sessions that none of the held ones holds too.
  const absl::flat_hash_set<PageId> held = HeldTier0PagesLocked();
  absl::flat_hash_set<PageId> freeable;
  for (const auto& [id, s] : sessions_) {
    if (StaysInTier0(*s)) continue;
    for (size_t i = s->first_live; i < s->pages.size(); ++i) {
      if (s->pages[i].tier == 0 && !held.contains(s->pages[i].id)) freeable.insert(s->pages[i].id);
    }
  }
  return pool_[0].num_free() + pool_[0].num_evictable() + static_cast<int64_t>(freeable.size());
}

bool KvCacheManager::FreesTier0Page(const Session& s) const {
  for (size_t i = s.first_live; i < s.pages.size(); ++i) {
    if (s.pages[i].tier == 0 && pool_[0].ref(s.pages[i].id) == 1) return true;
  }
  return false;
}

void KvCacheManager::DropTier1(int64_t n, const Session* protect) {
  while (pool_[1].num_free() < n) {
    // Idle sessions first: a running request whose pages go must recompute them.
    Session* victim = nullptr;
    for (auto& [id, sp] : sessions_) {
      Session& s = *sp;
      if (&s == protect || Pinned(s) || s.tier1_pages == 0) continue;
      if (victim == nullptr || (s.running != victim->running ? !s.running : s.last_use < victim->last_use)) {
        victim = &s;
      }
    }
    if (victim == nullptr) return;
    int64_t last = static_cast<int64_t>(victim->pages.size()) - 1;
    while (victim->pages[last].tier != 1) --last;
    const int64_t before = static_cast<int64_t>(victim->pages.size()) - victim->first_live;
    CutLocked(*victim, last * P());
    const int64_t lost = before - (static_cast<int64_t>(victim->pages.size()) - victim->first_live);
    ++counters_.drops;
    counters_.dropped_pages += lost;
    Emit(KvEventType::kSessionDropped, victim, lost);
  }
}

absl::StatusOr<int64_t> KvCacheManager::OffloadLocked(Session& s, bool allow_drop) {
  std::vector<int64_t> idx;
  for (int64_t i = s.first_live; i < static_cast<int64_t>(s.pages.size()); ++i) {
    if (s.pages[i].tier == 0) idx.push_back(i);
  }
  const int64_t need = static_cast<int64_t>(idx.size());
  if (need == 0) return 0;
  if (pool_[1].num_free() < need) DropTier1(need, &s);
  const int64_t k = std::min(need, pool_[1].num_free());
  if (k < need && !allow_drop) {
    return absl::ResourceExhaustedError(
        absl::StrCat("offload of ", QuoteSession(s.id), ": tier 1 has room for ", k, " of ", need, " pages"));
  }
  const int64_t per_batch = std::max<int64_t>(1, storage_[0]->copy_batch_bytes() / storage_[0]->page_bytes());
  std::vector<PageId> src, dst;
  std::vector<BlockHash> host_stored;  // full pages stay findable by hash in tier 1
  for (int64_t b = 0; b < k; b += per_batch) {
    src.clear();
    dst.clear();
    for (int64_t j = b; j < std::min(k, b + per_batch); ++j) {
      src.push_back(s.pages[idx[j]].id);
      dst.push_back(pool_[1].Allocate());
    }
    absl::Status copied = storage_[1]->CopyPages(*storage_[0], src, dst);
    if (!copied.ok()) {
      for (PageId d : dst) pool_[1].DecRef(d);
      EmitPrefixLocked(KvEventType::kPrefixStored, 1, std::move(host_stored));
      return copied;  // pages of earlier batches already moved: a consistent state
    }
    for (size_t j = 0; j < dst.size(); ++j) {
      KVCACHE_ASSIGN_OR_RETURN(tier1_checksum_[dst[j]], storage_[1]->Checksum(dst[j]));
      const int64_t i = idx[b + j];
      PageLoc& loc = s.pages[i];
      pool_[0].DecRef(loc.id);
      loc = PageLoc{1, dst[j]};
      ++s.tier1_pages;
      if (i < static_cast<int64_t>(s.hashes.size())) IndexHostPageLocked(dst[j], s.hashes[i], &host_stored);
    }
  }
  EmitPrefixLocked(KvEventType::kPrefixStored, 1, std::move(host_stored));
  if (k > 0) {
    ++counters_.offloads;
    counters_.offload_pages += k;
    counters_.offload_bytes += k * storage_[0]->page_bytes();
    Emit(KvEventType::kSessionOffloaded, &s, k);
  }
  if (k < need) {
    const int64_t before = static_cast<int64_t>(s.pages.size()) - s.first_live;
    CutLocked(s, idx[k] * P());
    const int64_t lost = before - (static_cast<int64_t>(s.pages.size()) - s.first_live);
    ++counters_.drops;
    counters_.dropped_pages += lost;
    Emit(KvEventType::kSessionDropped, &s, lost);
  }
  return k;
}

absl::Status KvCacheManager::RestoreLocked(Session& s, std::vector<std::string>* preempted) {
  const int64_t n = s.tier1_pages;
  if (n == 0) return absl::OkStatus();
  // Pinned while making room, so that nested tier-1 drops spare its pages.
  s.restoring = true;
  absl::Status room = MakeRoom(n, &s, preempted);
  s.restoring = false;
  if (!room.ok()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("restore of ", QuoteSession(s.id), ": ", room.message()));
  }
  std::vector<int64_t> idx;
  for (int64_t i = s.first_live; i < static_cast<int64_t>(s.pages.size()); ++i) {
    if (s.pages[i].tier == 1) idx.push_back(i);
  }
  std::vector<PageId> dst_all;
  dst_all.reserve(idx.size());
  for (size_t j = 0; j < idx.size(); ++j) dst_all.push_back(pool_[0].Allocate());
  const int64_t per_batch = std::max<int64_t>(1, storage_[0]->copy_batch_bytes() / storage_[0]->page_bytes());
  std::vector<PageId> src;
  absl::Status status;
  for (int64_t b = 0; b < n && status.ok(); b += per_batch) {
    const int64_t e = std::min(n, b + per_batch);
    src.clear();
    for (int64_t j = b; j < e; ++j) src.push_back(s.pages[idx[j]].id);
    status = storage_[0]->CopyPages(*storage_[1], src, absl::MakeConstSpan(dst_all).subspan(b, e - b));
    for (int64_t j = b; j < e && status.ok(); ++j) {
      absl::StatusOr<PageChecksum> sum = storage_[0]->Checksum(dst_all[j]);
      if (!sum.ok()) {
        status = sum.status();
      } else if (*sum != tier1_checksum_[src[j - b]]) {
        ++counters_.checksum_failures;
        status = absl::DataLossError(absl::StrCat("restore of ", QuoteSession(s.id),
                                                  ": checksum mismatch on page ", idx[j], " (tier-1 page ",
                                                  src[j - b], "); the session's cache was dropped"));
      }
    }
  }
  if (!status.ok()) {
    for (PageId d : dst_all) pool_[0].DecRef(d);
    if (absl::IsDataLoss(status)) {
      const int64_t lost = static_cast<int64_t>(s.pages.size()) - s.first_live;
      CutLocked(s, 0);
      ++counters_.drops;
      counters_.dropped_pages += lost;
      Emit(KvEventType::kSessionDropped, &s, lost);
    }
    return status;
  }
  for (size_t j = 0; j < idx.size(); ++j) {
    ReleaseLoc(s, idx[j]);
    s.pages[idx[j]] = PageLoc{0, dst_all[j]};
  }
  FlushHostRemovedLocked();
  ++counters_.restores;
  counters_.restore_pages += n;
  counters_.restore_bytes += n * storage_[0]->page_bytes();
  Emit(KvEventType::kSessionRestored, &s, n);
  // Restored full pages may serve other sessions again.
  std::vector<BlockHash> stored;
  for (size_t j = 0; j < idx.size(); ++j) {
    const int64_t i = idx[j];
    if (i < static_cast<int64_t>(s.hashes.size())) IndexDevicePageLocked(dst_all[j], s.hashes[i], &stored);
  }
  EmitPrefixLocked(KvEventType::kPrefixStored, 0, std::move(stored));
  return absl::OkStatus();
}

}  // namespace kvcache::kv
