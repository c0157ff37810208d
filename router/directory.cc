#include "router/directory.h"

#include <sys/mman.h>
#include <xxhash.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "absl/strings/str_cat.h"

namespace kvcache::router {
namespace {

constexpr uint8_t kDeviceBit = 1;
constexpr uint8_t kHostBit = 2;
constexpr uint32_t kTierMask = 3;

uint8_t TierBit(v1::Tier tier) { return tier == v1::TIER_HOST ? kHostBit : kDeviceBit; }

uint32_t Pack(uint32_t w, uint8_t bits) { return w << 2 | bits; }
uint32_t WorkerOf(uint32_t packed) { return packed >> 2; }
uint8_t BitsOf(uint32_t packed) { return static_cast<uint8_t>(packed & kTierMask); }

// Bytes a swiss table of this capacity holds: one slot and one control byte
// per entry of capacity (plus the cloned control group, ignored).
template <typename Table>
size_t TableBytes(const Table& t) {
  return t.capacity() * (sizeof(typename Table::value_type) + 1);
}

size_t HeapStringBytes(const std::string& s) {
  // Libstdc++ keeps up to 15 characters inside the string object.
  return s.capacity() > 15 ? s.capacity() + 1 : 0;
}

}  // namespace

bool BlockHashFromBytes(const std::string& bytes, BlockHash* out) {
  if (bytes.size() != out->bytes.size()) return false;
  std::memcpy(out->bytes.data(), bytes.data(), bytes.size());
  return true;
}

Directory::PageKey Directory::KeyOf(const BlockHash& h) {
  PageKey k;
  std::memcpy(&k, h.bytes.data(), sizeof(k));
  return k;
}

// ---- HugePageAllocator ----

namespace {
constexpr size_t kHugePage = size_t{2} << 20;
}  // namespace

template <typename T>
T* Directory::HugePageAllocator<T>::allocate(size_t n) {
  const size_t bytes = n * sizeof(T);
  if (bytes < kHugePage) return std::allocator<T>().allocate(n);
  const size_t rounded = (bytes + kHugePage - 1) / kHugePage * kHugePage;
  void* p = std::aligned_alloc(kHugePage, rounded);
  // Out of memory: end the process, as an uncaught std::bad_alloc would.
  if (p == nullptr) std::abort();
  madvise(p, rounded, MADV_HUGEPAGE);  // advice only: without huge pages it still works
  return static_cast<T*>(p);
}

template <typename T>
void Directory::HugePageAllocator<T>::deallocate(T* p, size_t n) {
  if (n * sizeof(T) < kHugePage) {
    std::allocator<T>().deallocate(p, n);
  } else {
    std::free(p);
  }
}

// ---- Holders ----

Directory::Holders::Holders(Holders&& o) noexcept : heap_(o.heap_), size_(o.size_), one_(o.one_) {
  o.heap_ = nullptr;
  o.size_ = 0;
}

Directory::Holders& Directory::Holders::operator=(Holders&& o) noexcept {
  if (this != &o) {
    std::free(heap_);
    heap_ = o.heap_;
    size_ = o.size_;
    one_ = o.one_;
    o.heap_ = nullptr;
    o.size_ = 0;
  }
  return *this;
}

Directory::Holders::~Holders() { std::free(heap_); }

uint32_t Directory::Holders::Capacity(uint32_t n) {
  uint32_t c = 2;
  while (c < n) c *= 2;
  return c;
}

int64_t Directory::Holders::Position(WorkerIndex w) const {
  const uint32_t* d = data();
  int64_t lo = 0;
  int64_t hi = size_;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (WorkerOf(d[mid]) < w) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  if (lo < size_ && WorkerOf(d[lo]) == w) return lo;
  return -lo - 1;
}

uint8_t Directory::Holders::Find(WorkerIndex w) const {
  const int64_t pos = Position(w);
  return pos >= 0 ? BitsOf(data()[pos]) : 0;
}

void Directory::Holders::Add(WorkerIndex w, uint8_t bits) {
  const int64_t pos = Position(w);
  if (pos >= 0) {
    uint32_t* d = size_ <= 1 ? &one_ : heap_;
    d[pos] |= bits;
    return;
  }
  const int64_t at = -pos - 1;
  if (size_ == 0) {
    one_ = Pack(w, bits);
    size_ = 1;
    return;
  }
  if (size_ == 1) {
    heap_ = static_cast<uint32_t*>(std::malloc(Capacity(2) * sizeof(uint32_t)));
    heap_[0] = one_;
  } else if (size_ + 1 > Capacity(size_)) {
    heap_ = static_cast<uint32_t*>(std::realloc(heap_, Capacity(size_ + 1) * sizeof(uint32_t)));
  }
  std::memmove(heap_ + at + 1, heap_ + at, (size_ - at) * sizeof(uint32_t));
  heap_[at] = Pack(w, bits);
  ++size_;
}

bool Directory::Holders::Clear(WorkerIndex w, uint8_t bits) {
  const int64_t pos = Position(w);
  if (pos < 0) return true;
  uint32_t* d = size_ <= 1 ? &one_ : heap_;
  d[pos] &= ~static_cast<uint32_t>(bits);
  if (BitsOf(d[pos]) != 0) return false;
  if (size_ == 1) {
    size_ = 0;
    return true;
  }
  std::memmove(heap_ + pos, heap_ + pos + 1, (size_ - pos - 1) * sizeof(uint32_t));
  --size_;
  if (size_ == 1) {
    one_ = heap_[0];
    std::free(heap_);
    heap_ = nullptr;
  }
  return true;
}

// ---- Directory ----

Directory::Directory() = default;
Directory::~Directory() = default;

Directory::WorkerIndex Directory::InternLocked(const WorkerId& w) {
  auto [it, inserted] = index_.try_emplace(w, 0);
  if (!inserted) return it->second;
  WorkerIndex i;
  if (!free_.empty()) {
    i = free_.back();
    free_.pop_back();
  } else {
    i = static_cast<WorkerIndex>(workers_.size());
    workers_.emplace_back();
  }
  it->second = i;
  WorkerState& s = workers_[i];
  s.name = w;
  s.live = true;
  return i;
}

std::optional<Directory::WorkerIndex> Directory::IndexLocked(const WorkerId& w) const {
  auto it = index_.find(w);
  if (it == index_.end()) return std::nullopt;
  return it->second;
}

namespace {

// Page keys of wire hashes (32 bytes each; others are skipped).
template <typename Hashes>
void KeysOf(const Hashes& hashes, std::vector<uint64_t>* keys) {
  keys->clear();
  keys->reserve(hashes.size());
  for (const std::string& b : hashes) {
    if (b.size() != sizeof(BlockHash::bytes)) continue;
    uint64_t k;
    std::memcpy(&k, b.data(), sizeof(k));  // KeyOf: the first 64 bits
    keys->push_back(k);
  }
}

constexpr size_t kPrefetchAhead = 8;

}  // namespace

void Directory::AddPagesLocked(absl::Span<const PageKey> keys, WorkerIndex w, uint8_t tier_bit) {
  WorkerState& state = workers_[w];
  for (size_t i = 0; i < keys.size(); ++i) {
    if (i + kPrefetchAhead < keys.size()) pages_.prefetch(keys[i + kPrefetchAhead]);
    Holders& h = pages_[keys[i]];
    if (h.Find(w) == 0) {
      ++prefix_entries_;
      ++state.page_count;
      state.page_log.push_back(keys[i]);
    }
    h.Add(w, tier_bit);
  }
  if (state.page_log.size() > 2 * static_cast<size_t>(state.page_count) + 1024) CompactLogLocked(w);
}

void Directory::RemovePagesLocked(absl::Span<const PageKey> keys, WorkerIndex w, uint8_t tier_bit) {
  for (size_t i = 0; i < keys.size(); ++i) {
    if (i + kPrefetchAhead < keys.size()) pages_.prefetch(keys[i + kPrefetchAhead]);
    auto it = pages_.find(keys[i]);
    if (it == pages_.end() || it->second.Find(w) == 0) continue;
    if (it->second.Clear(w, tier_bit)) {
      --prefix_entries_;
      --workers_[w].page_count;
    }
    if (it->second.empty()) pages_.erase(it);
  }
}

void Directory::CompactLogLocked(WorkerIndex w) {
  std::vector<PageKey>& log = workers_[w].page_log;
  std::sort(log.begin(), log.end());
  log.erase(std::unique(log.begin(), log.end()), log.end());
  size_t kept = 0;
  for (PageKey k : log) {
    auto it = pages_.find(k);
    if (it != pages_.end() && it->second.Find(w) != 0) log[kept++] = k;
  }
  log.resize(kept);
  log.shrink_to_fit();
}

void Directory::MarkLostLocked(const SessionKey& key, const WorkerId& worker) {
  const uint64_t number = ++lost_count_;
  lost_[key] = Lost{worker, number};
  lost_order_.emplace_back(key, number);
  while (lost_.size() > kMaxLost && !lost_order_.empty()) {
    auto it = lost_.find(lost_order_.front().first);
    if (it != lost_.end() && it->second.number == lost_order_.front().second) lost_.erase(it);
    lost_order_.pop_front();
  }
  // Entries of sessions listed again since are skipped when they reach the
  // front; keep the queue from growing past twice the bound with them.
  if (lost_order_.size() > 2 * kMaxLost) {
    std::deque<std::pair<SessionKey, uint64_t>> live;
    for (auto& entry : lost_order_) {
      auto it = lost_.find(entry.first);
      if (it != lost_.end() && it->second.number == entry.second) live.push_back(std::move(entry));
    }
    lost_order_ = std::move(live);
  }
}

std::optional<WorkerId> Directory::LostWith(const SessionKey& key) const {
  absl::MutexLock lock(&mu_);
  auto it = lost_.find(key);
  if (it == lost_.end()) return std::nullopt;
  return it->second.worker;
}

absl::Status Directory::LostError(const SessionKey& key, const WorkerId& worker) {
  return absl::UnavailableError(absl::StrCat("session '", key.session_id, "' was lost with worker ", worker,
                                             "; resend the whole conversation with FULL_CONTEXT"));
}

void Directory::ClaimLocked(const SessionKey& key, const SessionEntry& entry) {
  if (!lost_.empty()) lost_.erase(key);  // a claim per placement event: no hashing when none is lost
  auto [it, inserted] = sessions_.try_emplace(key, entry);
  if (inserted) {
    ++workers_[entry.worker].sessions;
    return;
  }
  if (it->second.worker == entry.worker) {
    it->second = entry;
    return;
  }
  // Another worker claimed it earlier and has not said it let go (its stream
  // may trail this one): keep that claim behind the new one.
  std::vector<SessionEntry>& older = older_claims_[key];
  older.erase(std::remove_if(older.begin(), older.end(),
                             [&](const SessionEntry& c) { return c.worker == entry.worker; }),
              older.end());
  older.push_back(it->second);
  --workers_[it->second.worker].sessions;
  ++workers_[entry.worker].sessions;
  it->second = entry;
}

bool Directory::WithdrawLocked(const SessionKey& key, WorkerIndex w) {
  auto oc = older_claims_.find(key);
  if (oc != older_claims_.end()) {
    auto& older = oc->second;
    older.erase(
        std::remove_if(older.begin(), older.end(), [&](const SessionEntry& c) { return c.worker == w; }),
        older.end());
  }
  bool gone = false;
  auto it = sessions_.find(key);
  if (it != sessions_.end() && it->second.worker == w) {
    --workers_[w].sessions;
    if (oc != older_claims_.end() && !oc->second.empty()) {
      it->second = oc->second.back();  // the latest claim still standing
      oc->second.pop_back();
      ++workers_[it->second.worker].sessions;
    } else {
      sessions_.erase(it);
      gone = true;
    }
  }
  if (oc != older_claims_.end() && oc->second.empty()) older_claims_.erase(oc);
  return gone;
}

Directory::SessionEntry* Directory::ClaimOfLocked(const SessionKey& key, WorkerIndex w) {
  auto it = sessions_.find(key);
  if (it != sessions_.end() && it->second.worker == w) return &it->second;
  auto oc = older_claims_.find(key);
  if (oc == older_claims_.end()) return nullptr;
  for (SessionEntry& c : oc->second) {
    if (c.worker == w) return &c;
  }
  return nullptr;
}

SessionLocation Directory::LocationLocked(const SessionKey& key, const SessionEntry& e) const {
  SessionLocation loc;
  loc.session_id = key.session_id;
  loc.tenant = key.tenant;
  loc.worker = workers_[e.worker].name;
  loc.tier = e.tier;
  loc.tokens = e.tokens;
  return loc;
}

void Directory::ForgetWorkerLocked(const WorkerId& w, std::vector<SessionKey>* lost,
                                   std::vector<SessionKey>* held_out) {
  const std::optional<WorkerIndex> wi = IndexLocked(w);
  if (!wi.has_value()) return;
  WorkerState& state = workers_[*wi];
  if (state.sessions > 0 || !older_claims_.empty()) {
    // A scan of the session table: sessions are few next to pages, and a
    // worker is forgotten or resynced rarely.
    std::vector<SessionKey> held;
    for (const auto& [key, e] : sessions_) {
      if (e.worker == *wi) held.push_back(key);
    }
    for (const auto& [key, older] : older_claims_) {
      for (const SessionEntry& c : older) {
        if (c.worker == *wi) held.push_back(key);
      }
    }
    for (const SessionKey& key : held) {
      if (WithdrawLocked(key, *wi) && lost != nullptr) lost->push_back(key);
    }
    if (held_out != nullptr) *held_out = std::move(held);
  }
  for (PageKey key : state.page_log) {
    auto it = pages_.find(key);
    if (it == pages_.end() || it->second.Find(*wi) == 0) continue;  // since removed, or a repeat
    it->second.Clear(*wi, kDeviceBit | kHostBit);
    --prefix_entries_;
    if (it->second.empty()) pages_.erase(it);
  }
  state = WorkerState{};
  index_.erase(w);
  free_.push_back(*wi);
}

void Directory::ApplySnapshot(const WorkerId& worker, const v1::WorkerSnapshot& snapshot) {
  absl::MutexLock lock(&mu_);
  // What the worker held before and no other worker holds: lost unless the
  // snapshot lists it again (a restarted process lists none of it).
  std::vector<SessionKey> unheld;
  ForgetWorkerLocked(worker, &unheld);
  const WorkerIndex wi = InternLocked(worker);
  auto stale = stale_.find(worker);
  absl::flat_hash_set<SessionKey> still_stale;  // marks of copies the snapshot lists
  for (const auto& s : snapshot.sessions()) {
    SessionKey key{s.tenant(), s.session_id()};
    if (stale != stale_.end() && stale->second.contains(key)) {
      if (ClaimedByAnotherLocked(key, wi)) {
        // The session moved on elsewhere while this copy was out of reach.
        stale_listed_.emplace_back(key, worker);
        still_stale.insert(std::move(key));
        continue;
      }
      // Nobody else holds it: the copy is the session (e.g. a worker that was
      // forgotten and came back before any turn recreated it elsewhere).
    }
    SessionEntry e;
    e.worker = wi;
    e.tier = s.state() == v1::SESSION_OFFLOADED ? v1::TIER_HOST : v1::TIER_DEVICE;
    e.tokens = s.tokens_cached();
    ClaimLocked(key, e);
  }
  for (const SessionKey& key : unheld) {
    if (!sessions_.contains(key)) MarkLostLocked(key, worker);
  }
  if (stale != stale_.end()) {
    if (still_stale.empty()) {
      stale_.erase(stale);
    } else {
      stale->second = std::move(still_stale);
    }
  }
  WorkerState& state = workers_[wi];
  state.page_log.reserve(snapshot.device_block_hashes_size() + snapshot.host_block_hashes_size());
  std::vector<PageKey> keys;
  KeysOf(snapshot.device_block_hashes(), &keys);
  AddPagesLocked(keys, wi, kDeviceBit);
  KeysOf(snapshot.host_block_hashes(), &keys);
  AddPagesLocked(keys, wi, kHostBit);
  state.info.set_worker_id(snapshot.worker_id());
  state.info.set_model_id(snapshot.model_id());
  *state.info.mutable_kv_shape() = snapshot.kv_shape();
  state.load = snapshot.load();
}

void Directory::ApplyEvent(const WorkerId& worker, const v1::CacheEvent& e) {
  absl::MutexLock lock(&mu_);
  const WorkerIndex wi = InternLocked(worker);
  switch (e.kind()) {
    case v1::CacheEvent::SESSION_PLACED:
    case v1::CacheEvent::SESSION_OFFLOADED:
    case v1::CacheEvent::SESSION_RESTORED: {
      // Workers name every session event's tenant; an event without one is
      // keyed under the empty tenant, which no caller has.
      SessionKey key{e.tenant(), e.session_id()};
      const v1::Tier tier = e.kind() == v1::CacheEvent::SESSION_OFFLOADED ? v1::TIER_HOST : v1::TIER_DEVICE;
      if (e.kind() == v1::CacheEvent::SESSION_PLACED) {
        ClearStaleLocked(key, worker);  // placed anew: a current copy
      } else if (IsStaleLocked(key, worker) && ClaimedByAnotherLocked(key, wi)) {
        break;  // a stale copy moving between tiers stays out of the way
      }
      SessionEntry* claim = ClaimOfLocked(key, wi);
      if (claim != nullptr && e.kind() != v1::CacheEvent::SESSION_PLACED) {
        // A holder moved it between its tiers: the claim stays where it ranks.
        claim->tier = tier;
        if (e.tokens() > 0) claim->tokens = e.tokens();
        break;
      }
      SessionEntry entry;
      entry.worker = wi;
      entry.tier = tier;
      entry.tokens = e.tokens();
      if (entry.tokens == 0 && e.kind() != v1::CacheEvent::SESSION_PLACED) {
        auto it = sessions_.find(key);
        if (it != sessions_.end()) entry.tokens = it->second.tokens;  // length unknown: keep what was known
      }
      ClaimLocked(key, entry);
      break;
    }
    case v1::CacheEvent::SESSION_TRUNCATED: {
      SessionEntry* claim = ClaimOfLocked(SessionKey{e.tenant(), e.session_id()}, wi);
      if (claim != nullptr) claim->tokens = e.tokens();
      break;
    }
    case v1::CacheEvent::SESSION_DROPPED:
    case v1::CacheEvent::SESSION_EXPORTED:
      // Withdraws this worker's claim only: a late event from a former holder
      // must not erase the session's new home, and a claim that another
      // stream has not yet withdrawn comes back when the newer one leaves.
      WithdrawLocked(SessionKey{e.tenant(), e.session_id()}, wi);
      ClearStaleLocked(SessionKey{e.tenant(), e.session_id()}, worker);
      break;
    case v1::CacheEvent::PREFIX_STORED:
    case v1::CacheEvent::PREFIX_REMOVED: {
      KeysOf(e.block_hashes(), &scratch_keys_);
      if (e.kind() == v1::CacheEvent::PREFIX_STORED) {
        AddPagesLocked(scratch_keys_, wi, TierBit(e.tier()));
      } else {
        RemovePagesLocked(scratch_keys_, wi, TierBit(e.tier()));
      }
      break;
    }
    default:
      break;
  }
}

void Directory::ApplyLoad(const WorkerId& worker, const v1::WorkerLoad& load) {
  absl::MutexLock lock(&mu_);
  workers_[InternLocked(worker)].load = load;
}

std::vector<SessionKey> Directory::RemoveWorker(const WorkerId& worker, bool may_return) {
  absl::MutexLock lock(&mu_);
  std::vector<SessionKey> lost, held;
  ForgetWorkerLocked(worker, &lost, &held);
  for (const SessionKey& key : lost) MarkLostLocked(key, worker);
  if (may_return) {
    for (SessionKey& key : held) stale_[worker].insert(std::move(key));
  } else {
    stale_.erase(worker);
  }
  return lost;
}

bool Directory::ClaimedByAnotherLocked(const SessionKey& key, WorkerIndex w) const {
  auto it = sessions_.find(key);
  if (it != sessions_.end() && it->second.worker != w) return true;
  auto oc = older_claims_.find(key);
  if (oc == older_claims_.end()) return false;
  return std::any_of(oc->second.begin(), oc->second.end(),
                     [w](const SessionEntry& c) { return c.worker != w; });
}

bool Directory::IsStaleLocked(const SessionKey& key, const WorkerId& w) const {
  auto it = stale_.find(w);
  return it != stale_.end() && it->second.contains(key);
}

void Directory::ClearStaleLocked(const SessionKey& key, const WorkerId& w) {
  auto it = stale_.find(w);
  if (it == stale_.end()) return;
  it->second.erase(key);
  if (it->second.empty()) stale_.erase(it);
}

void Directory::MarkStale(const SessionKey& key, const WorkerId& worker) {
  absl::MutexLock lock(&mu_);
  stale_[worker].insert(key);
}

void Directory::ClearStale(const SessionKey& key, const WorkerId& worker) {
  absl::MutexLock lock(&mu_);
  ClearStaleLocked(key, worker);
}

std::vector<std::pair<SessionKey, WorkerId>> Directory::TakeStaleCopies() {
  absl::MutexLock lock(&mu_);
  return std::exchange(stale_listed_, {});
}

uint64_t Directory::sessions_lost() const {
  absl::MutexLock lock(&mu_);
  return lost_count_;
}

size_t Directory::stale_copies() const {
  absl::MutexLock lock(&mu_);
  size_t n = 0;
  for (const auto& [w, keys] : stale_) n += keys.size();
  return n;
}

std::optional<SessionLocation> Directory::FindSession(const SessionKey& key) const {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(key);
  if (it == sessions_.end()) return std::nullopt;
  return LocationLocked(it->first, it->second);
}

std::optional<SessionLocation> Directory::AwaitSession(const SessionKey& key, absl::Duration timeout) const {
  absl::MutexLock lock(&mu_);
  auto known = [this, &key]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return sessions_.contains(key); };
  if (!mu_.AwaitWithTimeout(absl::Condition(&known), timeout)) return std::nullopt;
  auto it = sessions_.find(key);
  return LocationLocked(it->first, it->second);
}

void Directory::NoteSessionTokens(const SessionKey& key, const WorkerId& worker, int32_t tokens) {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(key);
  if (it != sessions_.end() && workers_[it->second.worker].name == worker) it->second.tokens = tokens;
}

std::optional<SessionLocation> Directory::AwaitSessionOff(const SessionKey& key, const WorkerId& worker,
                                                          absl::Duration timeout) const {
  absl::MutexLock lock(&mu_);
  auto off = [this, &key, &worker]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    // Absent counts as not yet moved: the source's removal and the target's
    // placement arrive on two streams, in either order.
    auto it = sessions_.find(key);
    return it != sessions_.end() && workers_[it->second.worker].name != worker;
  };
  mu_.AwaitWithTimeout(absl::Condition(&off), timeout);
  auto it = sessions_.find(key);
  if (it == sessions_.end()) return std::nullopt;
  return LocationLocked(it->first, it->second);
}

absl::StatusOr<SessionLocation> Directory::Lookup(const SessionKey& key, absl::Duration timeout) const {
  std::optional<SessionLocation> loc =
      timeout > absl::ZeroDuration() ? AwaitSession(key, timeout) : FindSession(key);
  if (loc.has_value()) return *std::move(loc);
  if (std::optional<WorkerId> with = LostWith(key)) return LostError(key, *with);
  return absl::NotFoundError(absl::StrCat("session '", key.session_id, "' not found"));
}

std::vector<SessionLocation> Directory::SessionsNamed(const std::string& session_id) const {
  absl::MutexLock lock(&mu_);
  std::vector<SessionLocation> out;
  for (const auto& [key, e] : sessions_) {
    if (key.session_id == session_id) out.push_back(LocationLocked(key, e));
  }
  return out;
}

absl::flat_hash_map<WorkerId, PrefixMatch> Directory::MatchPrefix(absl::Span<const BlockHash> chain) const {
  absl::MutexLock lock(&mu_);
  absl::flat_hash_map<WorkerId, PrefixMatch> out;
  // Workers still matching at this depth, sorted by index (as holders are),
  // with their matches so far and their tier bits for the last page counted.
  struct Alive {
    WorkerIndex worker;
    uint8_t bits;
    PrefixMatch match;
  };
  std::vector<Alive> alive;
  auto count = [](Alive& a, int64_t pages) {
    // Once a page is only in host memory, every later page needs a restore too.
    if ((a.bits & kDeviceBit) && a.match.host_pages == 0) {
      a.match.device_pages += static_cast<int>(pages);
    } else {
      a.match.host_pages += static_cast<int>(pages);
    }
  };
  // Pages after the last one merged whose holders (workers and tiers) are
  // identical to its: a shared system prompt is a run of such pages, held by
  // many workers, and costs one comparison per page instead of one per worker.
  int64_t run = 0;
  auto flush = [&] {
    if (run == 0) return;
    for (Alive& a : alive) count(a, run);
    run = 0;
  };
  const Holders* prev = nullptr;
  for (size_t depth = 0; depth < chain.size(); ++depth) {
    auto it = pages_.find(KeyOf(chain[depth]));
    if (it == pages_.end()) break;
    const Holders& holders = it->second;
    const uint32_t* d = holders.data();
    const uint32_t n = holders.size();
    if (prev == nullptr) {
      alive.reserve(n);
      out.reserve(n);  // every first-page holder gets an entry
      for (uint32_t i = 0; i < n; ++i) {
        alive.push_back({WorkerOf(d[i]), BitsOf(d[i]), {}});
        count(alive.back(), 1);
      }
      prev = &holders;
      continue;
    }
    if (n == prev->size() && std::memcmp(d, prev->data(), n * sizeof(uint32_t)) == 0) {
      ++run;
      continue;
    }
    flush();
    // Intersect `alive` with this page's holders: a merge when both are
    // comparable in size, a binary search per alive worker when the page is
    // held much more widely.
    size_t kept = 0;
    uint32_t j = 0;
    const bool search = alive.size() * 8 < n;
    for (Alive& a : alive) {
      uint8_t bits = 0;
      if (search) {
        bits = holders.Find(a.worker);
      } else {
        while (j < n && WorkerOf(d[j]) < a.worker) ++j;
        if (j < n && WorkerOf(d[j]) == a.worker) bits = BitsOf(d[j]);
      }
      if (bits == 0) {
        out.emplace(workers_[a.worker].name, a.match);
        continue;
      }
      a.bits = bits;
      count(a, 1);
      alive[kept++] = a;
    }
    alive.resize(kept);
    if (alive.empty()) break;
    prev = &holders;
  }
  flush();
  for (const Alive& a : alive) out.emplace(workers_[a.worker].name, a.match);
  return out;
}

std::optional<v1::WorkerLoad> Directory::Load(const WorkerId& worker) const {
  absl::MutexLock lock(&mu_);
  const std::optional<WorkerIndex> wi = IndexLocked(worker);
  if (!wi.has_value()) return std::nullopt;
  return workers_[*wi].load;
}

std::optional<v1::WorkerSnapshot> Directory::Describe(const WorkerId& worker) const {
  absl::MutexLock lock(&mu_);
  const std::optional<WorkerIndex> wi = IndexLocked(worker);
  if (!wi.has_value()) return std::nullopt;
  return workers_[*wi].info;
}

std::vector<SessionLocation> Directory::SessionsOn(const WorkerId& worker) const {
  absl::MutexLock lock(&mu_);
  std::vector<SessionLocation> out;
  const std::optional<WorkerIndex> wi = IndexLocked(worker);
  if (!wi.has_value() || workers_[*wi].sessions == 0) return out;
  for (const auto& [key, e] : sessions_) {
    if (e.worker == *wi) out.push_back(LocationLocked(key, e));
  }
  return out;
}

size_t Directory::prefix_entries() const {
  absl::MutexLock lock(&mu_);
  return prefix_entries_;
}

size_t Directory::distinct_pages() const {
  absl::MutexLock lock(&mu_);
  return pages_.size();
}

absl::flat_hash_map<WorkerId, int64_t> Directory::SessionCounts() const {
  absl::MutexLock lock(&mu_);
  absl::flat_hash_map<WorkerId, int64_t> counts;
  counts.reserve(index_.size());
  for (const auto& [name, wi] : index_) counts[name] = workers_[wi].sessions;
  return counts;
}

size_t Directory::session_count() const {
  absl::MutexLock lock(&mu_);
  return sessions_.size();
}

uint64_t Directory::Digest() const {
  absl::MutexLock lock(&mu_);
  // A sum of per-entry hashes: the same set gives the same sum in any order.
  std::vector<uint64_t> name_hash(workers_.size(), 0);
  for (size_t i = 0; i < workers_.size(); ++i) {
    if (workers_[i].live) name_hash[i] = XXH3_64bits(workers_[i].name.data(), workers_[i].name.size());
  }
  uint64_t sum = 0;
  for (const auto& [key, e] : sessions_) {
    const uint64_t fields[2] = {name_hash[e.worker], static_cast<uint64_t>(e.tier)};
    uint64_t h = XXH3_64bits_withSeed(fields, sizeof(fields), 0x5e55);
    h = XXH3_64bits_withSeed(key.tenant.data(), key.tenant.size(), h);
    h = XXH3_64bits_withSeed(key.session_id.data(), key.session_id.size(), h + 1);
    sum += h;
  }
  for (const auto& [key, holders] : pages_) {
    for (uint32_t i = 0; i < holders.size(); ++i) {
      const uint32_t p = holders.data()[i];
      const uint64_t fields[3] = {key, name_hash[WorkerOf(p)], BitsOf(p)};
      sum += XXH3_64bits_withSeed(fields, sizeof(fields), 0xb10c);
    }
  }
  return sum;
}

Directory::MemoryUsage Directory::Memory() const {
  absl::MutexLock lock(&mu_);
  MemoryUsage m;
  m.page_bytes = TableBytes(pages_);
  for (const auto& [key, holders] : pages_) m.page_bytes += holders.heap_bytes();
  for (const WorkerState& w : workers_) m.page_bytes += w.page_log.capacity() * sizeof(PageKey);
  m.session_bytes = TableBytes(sessions_) + TableBytes(older_claims_);
  for (const auto& [key, e] : sessions_) {
    m.session_bytes += HeapStringBytes(key.tenant) + HeapStringBytes(key.session_id);
  }
  return m;
}

}  // namespace kvcache::router
