#include "worker/kv/kv_cache_manager.h"

#include <algorithm>
#include <cassert>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/kv/session_key.h"

// The KvCacheManager's sessions and steps. The pressure policy, the prefix index
// and the observability calls live beside it (kv_pressure_policy.cc,
// kv_prefix_index.cc, kv_cache_stats.cc); kv_cache_manager.h is their contract.
namespace kvcache::kv {

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
  host_page_hash_.assign(static_cast<size_t>(pool_[1].capacity()), BlockHash{});
  host_indexed_.assign(static_cast<size_t>(pool_[1].capacity()), 0);
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
  if (closed_ids_.contains(id)) return absl::FailedPreconditionError(QuoteSession(id) + " is closed");
  return absl::NotFoundError(QuoteSession(id) + " not found");
}

absl::StatusOr<const KvCacheManager::Session*> KvCacheManager::Find(const std::string& id) const {
  auto it = sessions_.find(id);
  if (it != sessions_.end()) return it->second.get();
  if (closed_ids_.contains(id)) return absl::FailedPreconditionError(QuoteSession(id) + " is closed");
  return absl::NotFoundError(QuoteSession(id) + " not found");
}

void KvCacheManager::Emit(KvEventType type, const Session* s, int64_t pages, std::vector<BlockHash> hashes,
                          std::string target) {
  KvEvent e;
  e.type = type;
  if (s != nullptr) {
    e.session_id = s->id;
    e.tenant = s->tenant;
    e.num_tokens = static_cast<int64_t>(s->tokens.size());
  }
  e.pages = pages;
  e.hashes = std::move(hashes);
  e.target = std::move(target);
  events_.Append(std::move(e));
}

void KvCacheManager::ReleaseLoc(Session& s, int64_t index) {
  PageLoc& loc = s.pages[index];
  if (loc.tier == 0) {
    pool_[0].DecRef(loc.id);
  } else if (loc.tier == 1) {
    FreeTier1PageLocked(loc.id);
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
  FlushHostRemovedLocked();
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
  FlushHostRemovedLocked();
}

absl::StatusOr<PageChecksum> KvCacheManager::PageChecksumLocked(const Session& s, int64_t index) const {
  const PageLoc loc = s.pages[index];
  if (loc.tier == 1) return tier1_checksum_[loc.id];
  if (loc.tier == 0) return storage_[0]->Checksum(loc.id);
  return absl::InternalError(absl::StrCat(QuoteSession(s.id), ": page ", index, " was released"));
}

// --- sessions ----------------------------------------------------------------------

absl::Status KvCacheManager::CreateSession(const std::string& id, const std::string& tenant) {
  if (id.empty() || tenant.empty()) {
    return absl::InvalidArgumentError("session id and tenant must be non-empty");
  }
  absl::MutexLock l(&mu_);
  if (sessions_.contains(id)) return absl::AlreadyExistsError(QuoteSession(id) + " already exists");
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

void KvCacheManager::CloseLocked(Session& s, const std::string& moved_to) {
  for (int64_t i = s.first_live; i < static_cast<int64_t>(s.pages.size()); ++i) ReleaseLoc(s, i);
  s.pages.clear();
  FlushHostRemovedLocked();
  if (moved_to.empty()) {
    Emit(KvEventType::kSessionClosed, &s, 0);
  } else {
    Emit(KvEventType::kSessionMigrated, &s, 0, {}, moved_to);
  }
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

absl::Status KvCacheManager::CloseSession(const std::string& id, int64_t* pages_freed,
                                          const std::string& moved_to) {
  absl::MutexLock l(&mu_);
  KVCACHE_ASSIGN_OR_RETURN(Session * s, Find(id));
  if (s->in_step || s->export_frozen) {
    return absl::FailedPreconditionError(QuoteSession(id) + " is in a step or export; cannot close");
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
  CloseLocked(*s, moved_to);
  return absl::OkStatus();
}

absl::StatusOr<StepReservation> KvCacheManager::BeginStep(const std::string& id, int64_t n) {
  absl::MutexLock l(&mu_);
  KVCACHE_ASSIGN_OR_RETURN(Session * s, Find(id));
  if (s->in_step || s->export_frozen) {
    return absl::FailedPreconditionError(QuoteSession(id) + " already has a step or export in progress");
  }
  const int64_t len = static_cast<int64_t>(s->tokens.size());
  if (n < 0 || len + n > options_.max_session_tokens) {
    return absl::InvalidArgumentError(absl::StrCat(QuoteSession(id), ": cannot reserve ", n, " tokens on ",
                                                   len, " (limit ", options_.max_session_tokens, ")"));
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
  bool cow = n > 0 && tail.tier == 0 && (pool_[0].ref(tail.id) > 1 || pool_[0].cached(tail.id));
  absl::Status room = MakeRoom(add + (cow ? 1 : 0), s, &r.preempted);
  if (!room.ok() && cow && pool_[0].ref(tail.id) == 1) {
    // Only the prefix cache shares the tail page (the session was cut back
    // inside it, e.g. a FULL_CONTEXT turn that edits the last message): with
    // no page for the copy, the cache gives the page up and the step writes in
    // place. The step used to fail, also with nothing else on the worker.
    UnindexDevicePageLocked(tail.id);
    cow = false;
    room = MakeRoom(add, s, &r.preempted);
  }
  if (absl::Status st = room; !st.ok()) {
    s->in_step = false;
    return absl::ResourceExhaustedError(
        absl::StrCat("BeginStep of ", QuoteSession(id), " for ", n, " tokens: ", st.message()));
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
  if (!s->in_step) return absl::FailedPreconditionError(QuoteSession(id) + " has no step in progress");
  if (static_cast<int64_t>(tokens.size()) > s->reserved) {
    return absl::InvalidArgumentError(
        absl::StrCat(QuoteSession(id), ": committing ", tokens.size(), " tokens, reserved ", s->reserved));
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
  if (!s->in_step) return absl::FailedPreconditionError(QuoteSession(id) + " has no step in progress");
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
    return absl::FailedPreconditionError(QuoteSession(id) + " is in a step or export; cannot truncate");
  }
  if (num_tokens < 0 || num_tokens > static_cast<int64_t>(s->tokens.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat(QuoteSession(id), ": cannot truncate to ", num_tokens, " of ", s->tokens.size()));
  }
  if (!CutValid(*s, num_tokens)) {
    return absl::FailedPreconditionError(absl::StrCat(QuoteSession(id), ": truncating to ", num_tokens,
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
  if (sessions_.contains(dst_id)) return absl::AlreadyExistsError(QuoteSession(dst_id) + " already exists");
  if (src->in_step) {
    return absl::FailedPreconditionError(QuoteSession(src_id) + " is in a step; fork after it ends");
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
  if (Pinned(*s)) return absl::FailedPreconditionError(QuoteSession(id) + " is pinned or in a step");
  const int64_t live = static_cast<int64_t>(s->pages.size()) - s->first_live;
  if (live > pool_[1].capacity()) {
    return absl::ResourceExhaustedError(absl::StrCat("offload of ", QuoteSession(id), ": ", live,
                                                     " pages exceed tier 1 (", pool_[1].capacity(),
                                                     " pages)"));
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

SessionInfo KvCacheManager::SummaryLocked(const Session& s) const {
  SessionInfo info;
  info.id = s.id;
  info.tenant = s.tenant;
  info.num_tokens = static_cast<int64_t>(s.tokens.size());
  info.reserved_tokens = s.reserved;
  info.first_live_page = s.first_live;
  info.tier1_pages = s.tier1_pages;
  info.tier0_pages = static_cast<int64_t>(s.pages.size()) - s.first_live - s.tier1_pages;
  info.in_step = s.in_step;
  info.user_pinned = s.user_pinned;
  info.running = s.running;
  info.last_use = s.last_use;
  return info;
}

absl::StatusOr<SessionInfo> KvCacheManager::GetSession(const std::string& id) const {
  absl::MutexLock l(&mu_);
  KVCACHE_ASSIGN_OR_RETURN(const Session* s, Find(id));
  SessionInfo info = SummaryLocked(*s);
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

absl::StatusOr<int64_t> KvCacheManager::NumTokens(const std::string& id) const {
  absl::MutexLock l(&mu_);
  KVCACHE_ASSIGN_OR_RETURN(const Session* s, Find(id));
  return static_cast<int64_t>(s->tokens.size());
}

}  // namespace kvcache::kv
