// KvCacheManager: observability: stats, events, snapshots and the structural
// invariants check.
#include <algorithm>
#include <cassert>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/kv/kv_cache_manager.h"
#include "worker/kv/session_key.h"

namespace kvcache::kv {

KvStats KvCacheManager::GetStats() const {
  absl::MutexLock l(&mu_);
  KvStats st = counters_;
  TierStats& t0 = st.tier[0];
  t0.capacity_pages = pool_[0].capacity();
  t0.free_pages = pool_[0].num_free();
  t0.cached_unreferenced_pages = pool_[0].num_evictable();
  t0.prefix_shared_pages = static_cast<int64_t>(prefix_index_.size()) - pool_[0].num_evictable();
  t0.in_flight_pages = staging_pages_[0];
  t0.session_private_pages = t0.capacity_pages - t0.free_pages - t0.cached_unreferenced_pages -
                             t0.prefix_shared_pages - t0.in_flight_pages;
  TierStats& t1 = st.tier[1];
  t1.capacity_pages = pool_[1].capacity();
  t1.free_pages = pool_[1].num_free();
  t1.in_flight_pages = staging_pages_[1];
  t1.session_private_pages = t1.capacity_pages - t1.free_pages - t1.in_flight_pages;
  st.sessions = static_cast<int64_t>(sessions_.size());
  for (const auto& [id, s] : sessions_) {
    if (s->tier1_pages > 0) ++st.offloaded_sessions;
    const int64_t live = static_cast<int64_t>(s->pages.size()) - s->first_live;
    st.allocated_token_slots += live * P();
    st.used_token_slots += static_cast<int64_t>(s->tokens.size()) - s->first_live * P();
  }
  st.waste_token_slots = st.allocated_token_slots - st.used_token_slots;
  t0.held_pages = static_cast<int64_t>(HeldTier0PagesLocked().size());
  return st;
}

EventBatch KvCacheManager::ReadEvents(uint64_t after_seq, size_t max_events) const {
  absl::MutexLock l(&mu_);
  return events_.Read(after_seq, max_events);
}

KvSnapshot KvCacheManager::Snapshot() const {
  absl::MutexLock l(&mu_);
  KvSnapshot snap;
  snap.last_seq = events_.last_seq();
  for (const auto& [id, s] : sessions_) snap.sessions.push_back(SummaryLocked(*s));
  std::sort(snap.sessions.begin(), snap.sessions.end(),
            [](const SessionInfo& a, const SessionInfo& b) { return a.id < b.id; });
  for (const auto& [h, page] : prefix_index_) snap.prefix_hashes.push_back(h);
  std::sort(snap.prefix_hashes.begin(), snap.prefix_hashes.end());
  for (const auto& [h, page] : host_index_) snap.host_prefix_hashes.push_back(h);
  std::sort(snap.host_prefix_hashes.begin(), snap.host_prefix_hashes.end());
  return snap;
}

absl::Status KvCacheManager::CheckInvariants() const {
  absl::MutexLock l(&mu_);
  for (int t = 0; t < 2; ++t) {
    if (absl::Status st = pool_[t].CheckConsistency(); !st.ok()) {
      return absl::InternalError(absl::StrCat("tier ", t, ": ", st.message()));
    }
  }
  std::vector<int32_t> refs[2] = {std::vector<int32_t>(pool_[0].capacity(), 0),
                                  std::vector<int32_t>(pool_[1].capacity(), 0)};
  for (const auto& [id, sp] : sessions_) {
    const Session& s = *sp;
    const int64_t len = static_cast<int64_t>(s.tokens.size());
    const std::string who = QuoteSession(id);
    if (static_cast<int64_t>(s.pages.size()) != PagesFor(len + s.reserved) ||
        s.page_epoch.size() != s.pages.size()) {
      return absl::InternalError(
          absl::StrCat(who, ": ", s.pages.size(), " pages for ", len, "+", s.reserved, " tokens"));
    }
    if (s.reserved > 0 && !s.in_step) return absl::InternalError(who + ": reserved outside a step");
    if (static_cast<int64_t>(s.hashes.size()) != len / P()) {
      return absl::InternalError(who + ": hash count does not match full pages");
    }
    const int64_t w = options_.shape.sliding_window;
    const int64_t want_first = (w > 0 && len > w) ? (len - w) / P() : 0;
    if (s.first_live > std::max<int64_t>(want_first, 0) || (len > 0 && s.first_live < want_first)) {
      return absl::InternalError(
          absl::StrCat(who, ": first live page ", s.first_live, ", window wants ", want_first));
    }
    int64_t tier1 = 0;
    for (int64_t i = 0; i < static_cast<int64_t>(s.pages.size()); ++i) {
      const PageLoc loc = s.pages[i];
      if (i < s.first_live) {
        if (loc.tier != -1) return absl::InternalError(absl::StrCat(who, ": dead page ", i, " held"));
        continue;
      }
      if (loc.tier < 0 || loc.tier > 1 || !pool_[loc.tier].Valid(loc.id)) {
        return absl::InternalError(absl::StrCat(who, ": live page ", i, " has no location"));
      }
      ++refs[loc.tier][loc.id];
      if (loc.tier == 1) ++tier1;
    }
    if (tier1 != s.tier1_pages) return absl::InternalError(who + ": tier-1 page count off");
    if ((s.in_step || s.user_pinned) && tier1 > 0) {
      return absl::InternalError(who + ": pinned session has pages in tier 1");
    }
  }
  for (int t = 0; t < 2; ++t) {
    for (PageId id = 0; id < pool_[t].capacity(); ++id) {
      if (refs[t][id] != pool_[t].ref(id)) {
        return absl::InternalError(absl::StrCat("tier ", t, " page ", id, ": ref ", pool_[t].ref(id), " but ",
                                                refs[t][id], " referrers"));
      }
      if (t == 1 && (pool_[1].cached(id) || refs[1][id] > 1)) {
        return absl::InternalError(absl::StrCat("tier-1 page ", id, " shared or cached"));
      }
    }
  }
  for (int t = 0; t < 2; ++t) {
    int64_t staging = 0;
    for (PageId id = 0; id < pool_[t].capacity(); ++id) staging += pool_[t].IsStaging(id) ? 1 : 0;
    if (staging != staging_pages_[t])
      return absl::InternalError(absl::StrCat("tier ", t, ": staging page count off"));
  }
  int64_t cached = 0;
  for (PageId id = 0; id < pool_[0].capacity(); ++id) {
    if (!pool_[0].cached(id)) continue;
    ++cached;
    auto it = prefix_index_.find(page_hash_[id]);
    if (it == prefix_index_.end() || it->second != id) {
      return absl::InternalError(absl::StrCat("cached page ", id, " not in the prefix index"));
    }
  }
  if (cached != static_cast<int64_t>(prefix_index_.size())) {
    return absl::InternalError("prefix index has entries for uncached pages");
  }
  int64_t host_indexed = 0;
  for (PageId id = 0; id < pool_[1].capacity(); ++id) {
    if (!host_indexed_[id]) continue;
    ++host_indexed;
    auto it = host_index_.find(host_page_hash_[id]);
    if (it == host_index_.end() || it->second != id || refs[1][id] != 1) {
      return absl::InternalError(absl::StrCat("tier-1 page ", id, " indexed but not held under its hash"));
    }
  }
  if (host_indexed != static_cast<int64_t>(host_index_.size())) {
    return absl::InternalError("tier-1 prefix index has entries for unindexed pages");
  }
  if (!host_removed_.empty()) return absl::InternalError("tier-1 prefix removals not announced");
  return absl::OkStatus();
}

}  // namespace kvcache::kv
