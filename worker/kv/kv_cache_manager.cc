#include "worker/kv/kv_cache_manager.h"

#include <algorithm>
#include <cassert>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/kv/session_key.h"

namespace kvcache::kv {
namespace {

std::string Quote(const std::string& key) { return QuoteSession(key); }

}  // namespace

absl::StatusOr<std::unique_ptr<KvCacheManager>> KvCacheManager::Create(KvCacheOptions options) {
  KVCACHE_RETURN_IF_ERROR(ValidateShape(options.shape));
  const int64_t page_bytes = options.shape.page_bytes();
  const int64_t n0 = options.tier0_bytes / page_bytes;
  const int64_t n1 = std::max<int64_t>(0, options.tier1_bytes / page_bytes);
  if (n0 < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("tier-0 budget ", options.tier0_bytes, " bytes is under one page (", page_bytes, ")"));
  }
  if (n0 > INT32_MAX || n1 > INT32_MAX) return absl::InvalidArgumentError("too many pages");
  if (options.max_session_tokens < 1 || options.event_capacity < 1) {
    return absl::InvalidArgumentError("max_session_tokens and event_capacity must be >= 1");
  }
  if (options.model_id.empty()) return absl::InvalidArgumentError("model_id is empty");
  if (!options.storage_factory) {
    options.storage_factory = [](int, int64_t n, int64_t bytes) { return CreateCpuTierStorage(n, bytes); };
  }
  KVCACHE_ASSIGN_OR_RETURN(TierStoragePtr t0, options.storage_factory(0, n0, page_bytes));
  KVCACHE_ASSIGN_OR_RETURN(TierStoragePtr t1, options.storage_factory(1, n1, page_bytes));
  if (t0 == nullptr || t1 == nullptr || t0->num_pages() != n0 || t1->num_pages() != n1 ||
      t0->page_bytes() != page_bytes || t1->page_bytes() != page_bytes) {
    return absl::InternalError("storage factory returned a tier of the wrong size");
  }
  return std::unique_ptr<KvCacheManager>(
      new KvCacheManager(std::move(options), std::move(t0), std::move(t1)));
}

KvCacheManager::KvCacheManager(KvCacheOptions options, TierStoragePtr tier0, TierStoragePtr tier1)
    : options_(std::move(options)),
      storage_{tier0.get(), tier1.get()},
      pool_{PagePool(std::move(tier0)), PagePool(std::move(tier1))},
      events_(options_.event_capacity) {
  absl::MutexLock l(&mu_);
  tier1_checksum_.assign(static_cast<size_t>(pool_[1].capacity()), 0);
  page_hash_.assign(static_cast<size_t>(pool_[0].capacity()), BlockHash{});
}

KvCacheManager::~KvCacheManager() = default;

int64_t KvCacheManager::tier_capacity_pages(int tier) const {
  return storage_[tier == 0 ? 0 : 1]->num_pages();
}

uint8_t* KvCacheManager::Tier0PageData(PageId id) { return storage_[0]->PageData(id); }
TierStorage& KvCacheManager::tier_storage(int tier) { return *storage_[tier == 0 ? 0 : 1]; }

// --- helpers -------------------------------------------------------------------

absl::StatusOr<KvCacheManager::Session*> KvCacheManager::Find(const std::string& id) {
  auto it = sessions_.find(id);
  if (it != sessions_.end()) return it->second.get();
  if (closed_ids_.contains(id)) return absl::FailedPreconditionError(Quote(id) + " is closed");
  return absl::NotFoundError(Quote(id) + " not found");
}

absl::StatusOr<const KvCacheManager::Session*> KvCacheManager::Find(const std::string& id) const {
  auto it = sessions_.find(id);
  if (it != sessions_.end()) return it->second.get();
  if (closed_ids_.contains(id)) return absl::FailedPreconditionError(Quote(id) + " is closed");
  return absl::NotFoundError(Quote(id) + " not found");
}

void KvCacheManager::Emit(KvEventType type, const Session* s, int64_t pages, std::vector<BlockHash> hashes) {
  KvEvent e;
  e.type = type;
  if (s != nullptr) {
    e.session_id = s->id;
    e.tenant = s->tenant;
    e.num_tokens = static_cast<int64_t>(s->tokens.size());
  }
  e.pages = pages;
  e.hashes = std::move(hashes);
  events_.Append(std::move(e));
}

void KvCacheManager::ReleaseLoc(Session& s, int64_t index) {
  PageLoc& loc = s.pages[index];
  if (loc.tier == 0) {
    pool_[0].DecRef(loc.id);
  } else if (loc.tier == 1) {
    pool_[1].DecRef(loc.id);
    --s.tier1_pages;
  }
  loc = PageLoc{};
}

bool KvCacheManager::CutValid(const Session& s, int64_t len) const {
  const int64_t w = options_.shape.sliding_window;
  if (w == 0 || s.first_live == 0 || len == 0) return true;
  return s.first_live * P() <= len - w;
}

int64_t KvCacheManager::CutLocked(Session& s, int64_t len) {
  assert(s.reserved == 0 && len <= static_cast<int64_t>(s.tokens.size()));
  if (!CutValid(s, len)) len = 0;
  const int64_t keep = PagesFor(len);
  for (int64_t i = static_cast<int64_t>(s.pages.size()) - 1; i >= keep; --i) {
    if (i >= s.first_live) ReleaseLoc(s, i);
  }
  s.pages.resize(keep);
  s.page_epoch.resize(keep);
  s.tokens.resize(len);
  s.hashes.resize(std::min<size_t>(s.hashes.size(), len / P()));
  s.first_live = std::min(s.first_live, keep);
  return len;
}

void KvCacheManager::ApplyWindow(Session& s) {
  const int64_t w = options_.shape.sliding_window;
  const int64_t len = static_cast<int64_t>(s.tokens.size());
  if (w == 0 || len <= w) return;
  // Page i is dead when every position in it is < len - w.
  const int64_t new_first = (len - w) / P();
  for (int64_t i = s.first_live; i < new_first; ++i) ReleaseLoc(s, i);
  s.first_live = std::max(s.first_live, new_first);
}

void KvCacheManager::PublishFullPages(Session& s) {
  const int64_t full = static_cast<int64_t>(s.tokens.size()) / P();
  std::vector<BlockHash> stored;
  for (int64_t i = static_cast<int64_t>(s.hashes.size()); i < full; ++i) {
    const BlockHash parent = i == 0 ? BlockHash::Zero() : s.hashes[i - 1];
    const BlockHash h = ComputeBlockHash(parent, options_.model_id, s.tenant,
                                         absl::MakeConstSpan(s.tokens).subspan(i * P(), P()));
    s.hashes.push_back(h);
    const PageLoc loc = s.pages[i];
    if (loc.tier != 0 || pool_[0].cached(loc.id) || prefix_index_.contains(h)) continue;
    prefix_index_.emplace(h, loc.id);
    page_hash_[loc.id] = h;
    pool_[0].SetCached(loc.id, true);
    stored.push_back(h);
  }
  if (!stored.empty()) {
    counters_.prefix_pages_stored += static_cast<int64_t>(stored.size());
    Emit(KvEventType::kPrefixStored, nullptr, static_cast<int64_t>(stored.size()), std::move(stored));
  }
}

absl::StatusOr<PageChecksum> KvCacheManager::PageChecksumLocked(const Session& s, int64_t index) const {
  const PageLoc loc = s.pages[index];
  if (loc.tier == 1) return tier1_checksum_[loc.id];
  if (loc.tier == 0) return storage_[0]->Checksum(loc.id);
  return absl::InternalError(absl::StrCat(Quote(s.id), ": page ", index, " was released"));
}

// --- pressure policy -------------------------------------------------------------

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
    Session* victim = nullptr;
    for (const bool running : {false, true}) {
      if (running && preempted == nullptr) break;
      for (auto& [id, sp] : sessions_) {
        Session& s = *sp;
        const int64_t tier0 = static_cast<int64_t>(s.pages.size()) - s.first_live - s.tier1_pages;
        if (&s == protect || Pinned(s) || s.running != running || tier0 == 0) continue;
        if (victim == nullptr || s.last_use < victim->last_use) victim = &s;
      }
      if (victim != nullptr) break;
    }
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
  if (!evicted.empty()) {
    const int64_t count = static_cast<int64_t>(evicted.size());
    Emit(KvEventType::kPrefixRemoved, nullptr, count, std::move(evicted));
  }
  KVCACHE_RETURN_IF_ERROR(status);
  if (pool_[0].num_free() < n) {
    return absl::ResourceExhaustedError(
        absl::StrCat("need ", n, " free tier-0 pages, only ", pool_[0].num_free(),
                     " could be made free (the rest are pinned or in a step)"));
  }
  return absl::OkStatus();
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
        absl::StrCat("offload of ", Quote(s.id), ": tier 1 has room for ", k, " of ", need, " pages"));
  }
  const int64_t per_batch = std::max<int64_t>(1, storage_[0]->copy_batch_bytes() / storage_[0]->page_bytes());
  std::vector<PageId> src, dst;
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
      return copied;  // pages of earlier batches already moved: a consistent state
    }
    for (size_t j = 0; j < dst.size(); ++j) {
      KVCACHE_ASSIGN_OR_RETURN(tier1_checksum_[dst[j]], storage_[1]->Checksum(dst[j]));
      PageLoc& loc = s.pages[idx[b + j]];
      pool_[0].DecRef(loc.id);
      loc = PageLoc{1, dst[j]};
      ++s.tier1_pages;
    }
  }
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
    return absl::ResourceExhaustedError(absl::StrCat("restore of ", Quote(s.id), ": ", room.message()));
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
        status = absl::DataLossError(absl::StrCat("restore of ", Quote(s.id), ": checksum mismatch on page ",
                                                  idx[j], " (tier-1 page ", src[j - b],
                                                  "); the session's cache was dropped"));
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
  ++counters_.restores;
  counters_.restore_pages += n;
  counters_.restore_bytes += n * storage_[0]->page_bytes();
  Emit(KvEventType::kSessionRestored, &s, n);
  // Restored full pages may serve other sessions again.
  std::vector<BlockHash> stored;
  for (size_t j = 0; j < idx.size(); ++j) {
    const int64_t i = idx[j];
    if (i >= static_cast<int64_t>(s.hashes.size())) continue;
    const BlockHash& h = s.hashes[i];
    if (prefix_index_.contains(h)) continue;
    prefix_index_.emplace(h, dst_all[j]);
    page_hash_[dst_all[j]] = h;
    pool_[0].SetCached(dst_all[j], true);
    stored.push_back(h);
  }
  if (!stored.empty()) {
    counters_.prefix_pages_stored += static_cast<int64_t>(stored.size());
    Emit(KvEventType::kPrefixStored, nullptr, static_cast<int64_t>(stored.size()), std::move(stored));
  }
  return absl::OkStatus();
}

// --- sessions ----------------------------------------------------------------------

absl::Status KvCacheManager::CreateSession(const std::string& id, const std::string& tenant) {
  if (id.empty() || tenant.empty()) {
    return absl::InvalidArgumentError("session id and tenant must be non-empty");
  }
  absl::MutexLock l(&mu_);
  if (sessions_.contains(id)) return absl::AlreadyExistsError(Quote(id) + " already exists");
  closed_ids_.erase(id);
  auto s = std::make_unique<Session>();
  s->uid = next_uid_++;
  s->id = id;
  s->tenant = tenant;
  Touch(*s);
  Emit(KvEventType::kSessionPlaced, s.get(), 0);
  sessions_.emplace(id, std::move(s));
  return absl::OkStatus();
}

void KvCacheManager::CloseLocked(Session& s) {
  for (int64_t i = s.first_live; i < static_cast<int64_t>(s.pages.size()); ++i) ReleaseLoc(s, i);
  s.pages.clear();
  Emit(KvEventType::kSessionClosed, &s, 0);
  const std::string id = s.id;
  sessions_.erase(id);  // destroys s
  if (options_.closed_ids_remembered > 0 && closed_ids_.insert(id).second) {
    closed_order_.push_back(id);
    while (closed_order_.size() > options_.closed_ids_remembered) {
      closed_ids_.erase(closed_order_.front());
      closed_order_.pop_front();
    }
  }
}

absl::Status KvCacheManager::CloseSession(const std::string& id, int64_t* pages_freed) {
  absl::MutexLock l(&mu_);
  KVCACHE_ASSIGN_OR_RETURN(Session * s, Find(id));
  if (s->in_step || s->export_frozen) {
    return absl::FailedPreconditionError(Quote(id) + " is in a step or export; cannot close");
  }
  if (pages_freed != nullptr) {
    // Tier-1 pages are always private; a tier-0 page is freed when this session
    // holds its last reference (it may stay cached as an evictable prefix page).
    int64_t freed = 0;
    for (int64_t i = s->first_live; i < static_cast<int64_t>(s->pages.size()); ++i) {
      const PageLoc loc = s->pages[i];
      freed += loc.tier == 1 || (loc.tier == 0 && pool_[0].ref(loc.id) == 1);
    }
    *pages_freed = freed;
  }
  CloseLocked(*s);
  return absl::OkStatus();
}

absl::StatusOr<int64_t> KvCacheManager::AttachPrefix(const std::string& id,
                                                     absl::Span<const int32_t> prompt) {
  absl::MutexLock l(&mu_);
  KVCACHE_ASSIGN_OR_RETURN(Session * s, Find(id));
  if (!s->tokens.empty() || s->in_step || s->export_frozen) {
    return absl::FailedPreconditionError(Quote(id) + ": AttachPrefix needs an empty session");
  }
  if (static_cast<int64_t>(prompt.size()) > options_.max_session_tokens) {
    return absl::InvalidArgumentError(Quote(id) + ": prompt longer than max_session_tokens");
  }
  counters_.prefix_query_tokens += static_cast<int64_t>(prompt.size());
  BlockHash parent = BlockHash::Zero();
  const uint64_t epoch = ++write_epoch_;
  for (size_t i = 0; (i + 1) * P() <= prompt.size(); ++i) {
    const auto page_tokens = prompt.subspan(i * P(), P());
    const BlockHash h = ComputeBlockHash(parent, options_.model_id, s->tenant, page_tokens);
    auto it = prefix_index_.find(h);
    if (it == prefix_index_.end()) break;
    pool_[0].IncRef(it->second);
    s->pages.push_back(PageLoc{0, it->second});
    s->page_epoch.push_back(epoch);
    s->hashes.push_back(h);
    s->tokens.insert(s->tokens.end(), page_tokens.begin(), page_tokens.end());
    parent = h;
  }
  const int64_t hit = static_cast<int64_t>(s->tokens.size());
  counters_.prefix_hit_tokens += hit;
  ApplyWindow(*s);
  Touch(*s);
  return hit;
}

int64_t KvCacheManager::LookupPrefix(const std::string& tenant, absl::Span<const int32_t> tokens) const {
  absl::MutexLock l(&mu_);
  BlockHash parent = BlockHash::Zero();
  int64_t hit = 0;
  for (size_t i = 0; (i + 1) * P() <= tokens.size(); ++i) {
    parent = ComputeBlockHash(parent, options_.model_id, tenant, tokens.subspan(i * P(), P()));
    if (!prefix_index_.contains(parent)) break;
    hit += P();
  }
  return hit;
}

absl::StatusOr<StepReservation> KvCacheManager::BeginStep(const std::string& id, int64_t n) {
  absl::MutexLock l(&mu_);
  KVCACHE_ASSIGN_OR_RETURN(Session * s, Find(id));
  if (s->in_step || s->export_frozen) {
    return absl::FailedPreconditionError(Quote(id) + " already has a step or export in progress");
  }
  const int64_t len = static_cast<int64_t>(s->tokens.size());
  if (n < 0 || len + n > options_.max_session_tokens) {
    return absl::InvalidArgumentError(absl::StrCat(Quote(id), ": cannot reserve ", n, " tokens on ", len,
                                                   " (limit ", options_.max_session_tokens, ")"));
  }
  s->in_step = true;  // protects the session from the policy below
  StepReservation r;
  r.restored_pages = s->tier1_pages;
  if (absl::Status st = RestoreLocked(*s, &r.preempted); !st.ok()) {
    s->in_step = false;
    return st;
  }
  const int64_t add = PagesFor(len + n) - static_cast<int64_t>(s->pages.size());
  const PageLoc tail = len % P() != 0 ? s->pages[len / P()] : PageLoc{};
  const bool cow = n > 0 && tail.tier == 0 && (pool_[0].ref(tail.id) > 1 || pool_[0].cached(tail.id));
  if (absl::Status st = MakeRoom(add + (cow ? 1 : 0), s, &r.preempted); !st.ok()) {
    s->in_step = false;
    return absl::ResourceExhaustedError(
        absl::StrCat("BeginStep of ", Quote(id), " for ", n, " tokens: ", st.message()));
  }
  const uint64_t epoch = ++write_epoch_;
  if (cow) {
    const PageId copy = pool_[0].Allocate();
    const PageId src[1] = {tail.id};
    const PageId dst[1] = {copy};
    if (absl::Status st = storage_[0]->CopyPages(*storage_[0], src, dst); !st.ok()) {
      pool_[0].DecRef(copy);
      s->in_step = false;
      return st;
    }
    pool_[0].DecRef(tail.id);
    s->pages[len / P()].id = copy;
  }
  if (n > 0 && len % P() != 0) s->page_epoch[len / P()] = epoch;
  for (int64_t i = 0; i < add; ++i) {
    s->pages.push_back(PageLoc{0, pool_[0].Allocate()});
    s->page_epoch.push_back(epoch);
  }
  s->reserved = n;
  s->running = true;
  Touch(*s);
  r.first_pos = len;
  r.num_new_tokens = n;
  r.page_table.reserve(s->pages.size());
  for (const PageLoc& loc : s->pages) r.page_table.push_back(loc.tier == 0 ? loc.id : kNoPage);
  return r;
}

absl::Status KvCacheManager::CommitStep(const std::string& id, absl::Span<const int32_t> tokens) {
  absl::MutexLock l(&mu_);
  KVCACHE_ASSIGN_OR_RETURN(Session * s, Find(id));
  if (!s->in_step) return absl::FailedPreconditionError(Quote(id) + " has no step in progress");
  if (static_cast<int64_t>(tokens.size()) > s->reserved) {
    return absl::InvalidArgumentError(
        absl::StrCat(Quote(id), ": committing ", tokens.size(), " tokens, reserved ", s->reserved));
  }
  s->tokens.insert(s->tokens.end(), tokens.begin(), tokens.end());
  s->reserved = 0;
  const int64_t keep = PagesFor(static_cast<int64_t>(s->tokens.size()));
  while (static_cast<int64_t>(s->pages.size()) > keep) {
    ReleaseLoc(*s, static_cast<int64_t>(s->pages.size()) - 1);
    s->pages.pop_back();
    s->page_epoch.pop_back();
  }
  PublishFullPages(*s);
  ApplyWindow(*s);
  s->in_step = false;
  Touch(*s);
  return absl::OkStatus();
}

absl::Status KvCacheManager::AbortStep(const std::string& id) {
  absl::MutexLock l(&mu_);
  KVCACHE_ASSIGN_OR_RETURN(Session * s, Find(id));
  if (!s->in_step) return absl::FailedPreconditionError(Quote(id) + " has no step in progress");
  s->reserved = 0;
  const int64_t keep = PagesFor(static_cast<int64_t>(s->tokens.size()));
  while (static_cast<int64_t>(s->pages.size()) > keep) {
    ReleaseLoc(*s, static_cast<int64_t>(s->pages.size()) - 1);
    s->pages.pop_back();
    s->page_epoch.pop_back();
  }
  s->in_step = false;
  return absl::OkStatus();
}

absl::Status KvCacheManager::AppendTokens(const std::string& id, absl::Span<const int32_t> tokens) {
  KVCACHE_ASSIGN_OR_RETURN(StepReservation r, BeginStep(id, static_cast<int64_t>(tokens.size())));
  (void)r;
  return CommitStep(id, tokens);
}

absl::Status KvCacheManager::Truncate(const std::string& id, int64_t num_tokens) {
  absl::MutexLock l(&mu_);
  KVCACHE_ASSIGN_OR_RETURN(Session * s, Find(id));
  if (s->in_step || s->export_frozen) {
    return absl::FailedPreconditionError(Quote(id) + " is in a step or export; cannot truncate");
  }
  if (num_tokens < 0 || num_tokens > static_cast<int64_t>(s->tokens.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat(Quote(id), ": cannot truncate to ", num_tokens, " of ", s->tokens.size()));
  }
  if (!CutValid(*s, num_tokens)) {
    return absl::FailedPreconditionError(absl::StrCat(Quote(id), ": truncating to ", num_tokens,
                                                      " needs pages the sliding window already released"));
  }
  CutLocked(*s, num_tokens);
  Touch(*s);
  return absl::OkStatus();
}

absl::Status KvCacheManager::Fork(const std::string& src_id, const std::string& dst_id) {
  if (dst_id.empty()) return absl::InvalidArgumentError("fork target id is empty");
  absl::MutexLock l(&mu_);
  KVCACHE_ASSIGN_OR_RETURN(Session * src, Find(src_id));
  if (sessions_.contains(dst_id)) return absl::AlreadyExistsError(Quote(dst_id) + " already exists");
  if (src->in_step) {
    return absl::FailedPreconditionError(Quote(src_id) + " is in a step; fork after it ends");
  }
  KVCACHE_RETURN_IF_ERROR(RestoreLocked(*src, nullptr));
  const int64_t len = static_cast<int64_t>(src->tokens.size());
  const bool partial = len % P() != 0;
  KVCACHE_RETURN_IF_ERROR(MakeRoom(partial ? 1 : 0, src, nullptr));
  auto d = std::make_unique<Session>();
  d->uid = next_uid_++;
  d->id = dst_id;
  d->tenant = src->tenant;
  d->tokens = src->tokens;
  d->hashes = src->hashes;
  d->first_live = src->first_live;
  d->pages.resize(src->pages.size());
  d->page_epoch.assign(src->pages.size(), ++write_epoch_);
  const int64_t full = len / P();
  if (partial) {  // copy first: nothing to undo if it fails
    const PageId copy = pool_[0].Allocate();
    const PageId from[1] = {src->pages[full].id};
    const PageId to[1] = {copy};
    if (absl::Status st = storage_[0]->CopyPages(*storage_[0], from, to); !st.ok()) {
      pool_[0].DecRef(copy);
      return st;
    }
    d->pages[full] = PageLoc{0, copy};
  }
  for (int64_t i = src->first_live; i < full; ++i) {
    pool_[0].IncRef(src->pages[i].id);
    d->pages[i] = src->pages[i];
  }
  Touch(*src);
  Touch(*d);
  Emit(KvEventType::kSessionPlaced, d.get(), static_cast<int64_t>(d->pages.size()) - d->first_live);
  sessions_.emplace(dst_id, std::move(d));
  return absl::OkStatus();
}

absl::Status KvCacheManager::Offload(const std::string& id) {
  absl::MutexLock l(&mu_);
  KVCACHE_ASSIGN_OR_RETURN(Session * s, Find(id));
  if (Pinned(*s)) return absl::FailedPreconditionError(Quote(id) + " is pinned or in a step");
  const int64_t live = static_cast<int64_t>(s->pages.size()) - s->first_live;
  if (live > pool_[1].capacity()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "offload of ", Quote(id), ": ", live, " pages exceed tier 1 (", pool_[1].capacity(), " pages)"));
  }
  return OffloadLocked(*s, /*allow_drop=*/false).status();
}

absl::Status KvCacheManager::Restore(const std::string& id) {
  absl::MutexLock l(&mu_);
  KVCACHE_ASSIGN_OR_RETURN(Session * s, Find(id));
  return RestoreLocked(*s, nullptr);
}

absl::Status KvCacheManager::PinSession(const std::string& id) {
  absl::MutexLock l(&mu_);
  KVCACHE_ASSIGN_OR_RETURN(Session * s, Find(id));
  KVCACHE_RETURN_IF_ERROR(RestoreLocked(*s, nullptr));
  s->user_pinned = true;
  return absl::OkStatus();
}

absl::Status KvCacheManager::UnpinSession(const std::string& id) {
  absl::MutexLock l(&mu_);
  KVCACHE_ASSIGN_OR_RETURN(Session * s, Find(id));
  s->user_pinned = false;
  return absl::OkStatus();
}

absl::Status KvCacheManager::MarkIdle(const std::string& id) {
  absl::MutexLock l(&mu_);
  KVCACHE_ASSIGN_OR_RETURN(Session * s, Find(id));
  s->running = false;
  return absl::OkStatus();
}

absl::StatusOr<SessionInfo> KvCacheManager::GetSession(const std::string& id) const {
  absl::MutexLock l(&mu_);
  KVCACHE_ASSIGN_OR_RETURN(const Session* s, Find(id));
  SessionInfo info;
  info.id = s->id;
  info.tenant = s->tenant;
  info.num_tokens = static_cast<int64_t>(s->tokens.size());
  info.reserved_tokens = s->reserved;
  info.first_live_page = s->first_live;
  info.tier1_pages = s->tier1_pages;
  info.tier0_pages = static_cast<int64_t>(s->pages.size()) - s->first_live - s->tier1_pages;
  info.in_step = s->in_step;
  info.user_pinned = s->user_pinned;
  info.running = s->running;
  info.last_use = s->last_use;
  for (const PageLoc& loc : s->pages) {
    info.page_tiers.push_back(loc.tier);
    info.page_ids.push_back(loc.id);
    if (loc.tier == 0 && pool_[0].ref(loc.id) > 1) ++info.shared_pages;
  }
  return info;
}

absl::StatusOr<std::vector<int32_t>> KvCacheManager::GetTokens(const std::string& id) const {
  absl::MutexLock l(&mu_);
  KVCACHE_ASSIGN_OR_RETURN(const Session* s, Find(id));
  return s->tokens;
}

// --- observability -------------------------------------------------------------------

KvStats KvCacheManager::GetStats() const {
  absl::MutexLock l(&mu_);
  KvStats st = counters_;
  TierStats& t0 = st.tier[0];
  t0.capacity_pages = pool_[0].capacity();
  t0.free_pages = pool_[0].num_free();
  t0.cached_unreferenced_pages = pool_[0].num_evictable();
  t0.prefix_shared_pages = static_cast<int64_t>(prefix_index_.size()) - pool_[0].num_evictable();
  t0.in_flight_pages = staging_pages_;
  t0.session_private_pages = t0.capacity_pages - t0.free_pages - t0.cached_unreferenced_pages -
                             t0.prefix_shared_pages - t0.in_flight_pages;
  TierStats& t1 = st.tier[1];
  t1.capacity_pages = pool_[1].capacity();
  t1.free_pages = pool_[1].num_free();
  t1.session_private_pages = t1.capacity_pages - t1.free_pages;
  st.sessions = static_cast<int64_t>(sessions_.size());
  for (const auto& [id, s] : sessions_) {
    if (s->tier1_pages > 0) ++st.offloaded_sessions;
    const int64_t live = static_cast<int64_t>(s->pages.size()) - s->first_live;
    st.allocated_token_slots += live * P();
    st.used_token_slots += static_cast<int64_t>(s->tokens.size()) - s->first_live * P();
  }
  st.waste_token_slots = st.allocated_token_slots - st.used_token_slots;
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
  for (const auto& [id, s] : sessions_) {
    SessionInfo info;
    info.id = s->id;
    info.tenant = s->tenant;
    info.num_tokens = static_cast<int64_t>(s->tokens.size());
    info.first_live_page = s->first_live;
    info.tier1_pages = s->tier1_pages;
    info.tier0_pages = static_cast<int64_t>(s->pages.size()) - s->first_live - s->tier1_pages;
    info.in_step = s->in_step;
    info.user_pinned = s->user_pinned;
    info.running = s->running;
    info.last_use = s->last_use;
    snap.sessions.push_back(std::move(info));
  }
  std::sort(snap.sessions.begin(), snap.sessions.end(),
            [](const SessionInfo& a, const SessionInfo& b) { return a.id < b.id; });
  for (const auto& [h, page] : prefix_index_) snap.prefix_hashes.push_back(h);
  std::sort(snap.prefix_hashes.begin(), snap.prefix_hashes.end());
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
    const std::string who = Quote(id);
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
  int64_t staging = 0;
  int64_t cached = 0;
  for (PageId id = 0; id < pool_[0].capacity(); ++id) {
    if (pool_[0].IsStaging(id)) ++staging;
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
  if (staging != staging_pages_) return absl::InternalError("staging page count off");
  return absl::OkStatus();
}

}  // namespace kvcache::kv
