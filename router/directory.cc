#include "router/directory.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace kvcache::router {
namespace {

constexpr uint8_t kDeviceBit = 1;
constexpr uint8_t kHostBit = 2;

uint8_t TierBit(v1::Tier tier) { return tier == v1::TIER_HOST ? kHostBit : kDeviceBit; }

}  // namespace

bool BlockHashFromBytes(const std::string& bytes, BlockHash* out) {
  if (bytes.size() != out->bytes.size()) return false;
  std::memcpy(out->bytes.data(), bytes.data(), bytes.size());
  return true;
}

void Directory::AddPageLocked(const BlockHash& h, const WorkerId& w, uint8_t tier_bit) {
  pages_[h].workers[w] |= tier_bit;
}

void Directory::RemovePageLocked(const BlockHash& h, const WorkerId& w, uint8_t tier_bit) {
  auto it = pages_.find(h);
  if (it == pages_.end()) return;
  auto wit = it->second.workers.find(w);
  if (wit == it->second.workers.end()) return;
  wit->second &= static_cast<uint8_t>(~tier_bit);
  if (wit->second == 0) it->second.workers.erase(wit);
  if (it->second.workers.empty()) pages_.erase(it);
}

void Directory::PutSessionLocked(const SessionLocation& loc) {
  auto [it, inserted] = sessions_.try_emplace(loc.key(), loc);
  if (!inserted) {
    --workers_[it->second.worker].sessions;
    it->second = loc;
  }
  ++workers_[loc.worker].sessions;
}

void Directory::EraseSessionLocked(absl::flat_hash_map<SessionKey, SessionLocation>::iterator it) {
  --workers_[it->second.worker].sessions;
  sessions_.erase(it);
}

void Directory::ForgetWorkerLocked(const WorkerId& w, std::vector<SessionKey>* lost) {
  for (auto it = sessions_.begin(); it != sessions_.end();) {
    if (it->second.worker == w) {
      if (lost != nullptr) lost->push_back(it->first);
      sessions_.erase(it++);
    } else {
      ++it;
    }
  }
  for (auto it = pages_.begin(); it != pages_.end();) {
    it->second.workers.erase(w);
    if (it->second.workers.empty()) {
      pages_.erase(it++);
    } else {
      ++it;
    }
  }
  workers_.erase(w);
}

void Directory::ApplySnapshot(const WorkerId& worker, const v1::WorkerSnapshot& snapshot) {
  absl::MutexLock lock(&mu_);
  ForgetWorkerLocked(worker, nullptr);
  for (const auto& s : snapshot.sessions()) {
    SessionLocation loc;
    loc.session_id = s.session_id();
    loc.worker = worker;
    loc.tier = s.state() == v1::SESSION_OFFLOADED ? v1::TIER_HOST : v1::TIER_DEVICE;
    loc.tokens = s.tokens_cached();
    loc.tenant = s.tenant();
    PutSessionLocked(loc);
  }
  BlockHash h;
  for (const auto& b : snapshot.device_block_hashes()) {
    if (BlockHashFromBytes(b, &h)) AddPageLocked(h, worker, kDeviceBit);
  }
  for (const auto& b : snapshot.host_block_hashes()) {
    if (BlockHashFromBytes(b, &h)) AddPageLocked(h, worker, kHostBit);
  }
  WorkerState& state = workers_[worker];
  state.info.set_worker_id(snapshot.worker_id());
  state.info.set_model_id(snapshot.model_id());
  *state.info.mutable_kv_shape() = snapshot.kv_shape();
  state.load = snapshot.load();
}

void Directory::ApplyEvent(const WorkerId& worker, const v1::CacheEvent& e) {
  // Workers name every session event's tenant; an event without one is keyed
  // under the empty tenant, which no caller has.
  const SessionKey key{e.tenant(), e.session_id()};
  absl::MutexLock lock(&mu_);
  switch (e.kind()) {
    case v1::CacheEvent::SESSION_PLACED:
    case v1::CacheEvent::SESSION_OFFLOADED:
    case v1::CacheEvent::SESSION_RESTORED: {
      auto it = sessions_.find(key);
      SessionLocation loc = it != sessions_.end() ? it->second : SessionLocation{};
      loc.session_id = e.session_id();
      loc.tenant = e.tenant();
      loc.worker = worker;
      loc.tier = e.kind() == v1::CacheEvent::SESSION_OFFLOADED ? v1::TIER_HOST : v1::TIER_DEVICE;
      if (e.tokens() > 0 || e.kind() == v1::CacheEvent::SESSION_PLACED) loc.tokens = e.tokens();
      PutSessionLocked(loc);
      break;
    }
    case v1::CacheEvent::SESSION_TRUNCATED: {
      auto it = sessions_.find(key);
      if (it != sessions_.end() && it->second.worker == worker) it->second.tokens = e.tokens();
      break;
    }
    case v1::CacheEvent::SESSION_DROPPED:
    case v1::CacheEvent::SESSION_EXPORTED: {
      // Only the holder may drop it: a late event from a former holder must not
      // erase the session's new home.
      auto it = sessions_.find(key);
      if (it != sessions_.end() && it->second.worker == worker) EraseSessionLocked(it);
      break;
    }
    case v1::CacheEvent::PREFIX_STORED:
    case v1::CacheEvent::PREFIX_REMOVED: {
      BlockHash h;
      for (const auto& b : e.block_hashes()) {
        if (!BlockHashFromBytes(b, &h)) continue;
        if (e.kind() == v1::CacheEvent::PREFIX_STORED) {
          AddPageLocked(h, worker, TierBit(e.tier()));
        } else {
          RemovePageLocked(h, worker, TierBit(e.tier()));
        }
      }
      break;
    }
    default:
      break;
  }
}

void Directory::ApplyLoad(const WorkerId& worker, const v1::WorkerLoad& load) {
  absl::MutexLock lock(&mu_);
  workers_[worker].load = load;
}

std::vector<SessionKey> Directory::RemoveWorker(const WorkerId& worker) {
  absl::MutexLock lock(&mu_);
  std::vector<SessionKey> lost;
  ForgetWorkerLocked(worker, &lost);
  return lost;
}

std::optional<SessionLocation> Directory::FindSession(const SessionKey& key) const {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(key);
  if (it == sessions_.end()) return std::nullopt;
  return it->second;
}

std::optional<SessionLocation> Directory::AwaitSession(const SessionKey& key, absl::Duration timeout) const {
  absl::MutexLock lock(&mu_);
  auto known = [this, &key]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return sessions_.contains(key); };
  if (!mu_.AwaitWithTimeout(absl::Condition(&known), timeout)) return std::nullopt;
  return sessions_.at(key);
}

void Directory::NoteSessionTokens(const SessionKey& key, const WorkerId& worker, int32_t tokens) {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(key);
  if (it != sessions_.end() && it->second.worker == worker) it->second.tokens = tokens;
}

std::optional<SessionLocation> Directory::AwaitSessionOff(const SessionKey& key, const WorkerId& worker,
                                                          absl::Duration timeout) const {
  absl::MutexLock lock(&mu_);
  auto off = [this, &key, &worker]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    // Absent counts as not yet moved: the source's removal and the target's
    // placement arrive on two streams, in either order.
    auto it = sessions_.find(key);
    return it != sessions_.end() && it->second.worker != worker;
  };
  mu_.AwaitWithTimeout(absl::Condition(&off), timeout);
  auto it = sessions_.find(key);
  if (it == sessions_.end()) return std::nullopt;
  return it->second;
}

absl::StatusOr<SessionLocation> Directory::Lookup(const SessionKey& key, absl::Duration timeout) const {
  std::optional<SessionLocation> loc =
      timeout > absl::ZeroDuration() ? AwaitSession(key, timeout) : FindSession(key);
  if (!loc.has_value()) return absl::NotFoundError(absl::StrCat("session '", key.session_id, "' not found"));
  return *std::move(loc);
}

std::vector<SessionLocation> Directory::SessionsNamed(const std::string& session_id) const {
  absl::MutexLock lock(&mu_);
  std::vector<SessionLocation> out;
  for (const auto& [key, loc] : sessions_) {
    if (key.session_id == session_id) out.push_back(loc);
  }
  return out;
}

absl::flat_hash_map<WorkerId, PrefixMatch> Directory::MatchPrefix(absl::Span<const BlockHash> chain) const {
  absl::MutexLock lock(&mu_);
  absl::flat_hash_map<WorkerId, PrefixMatch> out;
  absl::flat_hash_map<WorkerId, bool> alive;  // still matching at this depth
  for (size_t i = 0; i < chain.size(); ++i) {
    auto it = pages_.find(chain[i]);
    if (it == pages_.end()) break;
    bool any = false;
    if (i == 0) {
      for (const auto& [w, bits] : it->second.workers) alive[w] = true;
    }
    for (auto& [w, still] : alive) {
      if (!still) continue;
      auto wit = it->second.workers.find(w);
      if (wit == it->second.workers.end()) {
        still = false;
        continue;
      }
      PrefixMatch& m = out[w];
      // Once a page is only in host memory, every later page needs a restore too.
      if ((wit->second & kDeviceBit) && m.host_pages == 0) {
        ++m.device_pages;
      } else {
        ++m.host_pages;
      }
      any = true;
    }
    if (!any) break;
  }
  return out;
}

std::optional<v1::WorkerLoad> Directory::Load(const WorkerId& worker) const {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(worker);
  if (it == workers_.end()) return std::nullopt;
  return it->second.load;
}

std::optional<v1::WorkerSnapshot> Directory::Describe(const WorkerId& worker) const {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(worker);
  if (it == workers_.end()) return std::nullopt;
  return it->second.info;
}

std::vector<SessionLocation> Directory::SessionsOn(const WorkerId& worker) const {
  absl::MutexLock lock(&mu_);
  std::vector<SessionLocation> out;
  for (const auto& [id, loc] : sessions_) {
    if (loc.worker == worker) out.push_back(loc);
  }
  return out;
}

size_t Directory::prefix_entries() const {
  absl::MutexLock lock(&mu_);
  size_t n = 0;
  for (const auto& [h, holders] : pages_) n += holders.workers.size();
  return n;
}

absl::flat_hash_map<WorkerId, int64_t> Directory::SessionCounts() const {
  absl::MutexLock lock(&mu_);
  absl::flat_hash_map<WorkerId, int64_t> counts;
  for (const auto& [worker, state] : workers_) counts[worker] = state.sessions;
  return counts;
}

size_t Directory::session_count() const {
  absl::MutexLock lock(&mu_);
  return sessions_.size();
}

}  // namespace kvcache::router
