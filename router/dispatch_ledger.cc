#include "router/dispatch_ledger.h"

#include <algorithm>
#include <cassert>

#include "absl/algorithm/container.h"

namespace kvcache::router {

void DispatchLedger::Dispatch(const std::string& worker, absl::Span<const BlockHash> chain,
                              int64_t prefill_tokens) {
  absl::MutexLock lock(&mu_);
  PerWorker& w = workers_[worker];
  ++w.out.requests;
  w.out.prefill_tokens += prefill_tokens;
  for (const BlockHash& h : chain) ++w.pages[h];
}

void DispatchLedger::PrefillDone(const std::string& worker, int64_t prefill_tokens) {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(worker);
  assert(it != workers_.end());
  if (it != workers_.end()) it->second.out.prefill_tokens -= prefill_tokens;
}

void DispatchLedger::Finish(const std::string& worker, absl::Span<const BlockHash> chain,
                            int64_t prefill_tokens, bool computed) {
  absl::MutexLock lock(&mu_);
  if (computed && !chain.empty()) {
    const absl::Time now = absl::Now();
    Finished& f = finished_[worker];
    for (const BlockHash& h : chain) f.until[h] = now + kFinishedGrace;
    if (f.until.size() >= f.purge_at) {  // amortised: the map at least doubles between purges
      absl::erase_if(f.until, [now](const auto& e) { return e.second <= now; });
      f.purge_at = std::max<size_t>(1024, 2 * f.until.size());
    }
  }
  auto it = workers_.find(worker);
  assert(it != workers_.end());
  if (it == workers_.end()) return;
  PerWorker& w = it->second;
  --w.out.requests;
  w.out.prefill_tokens -= prefill_tokens;
  for (const BlockHash& h : chain) {
    auto p = w.pages.find(h);
    assert(p != w.pages.end());
    if (p != w.pages.end() && --p->second == 0) w.pages.erase(p);
  }
  if (w.out.requests == 0) {
    assert(w.out.prefill_tokens == 0 && w.pages.empty());
    workers_.erase(it);
  }
}

DispatchLedger::Outstanding DispatchLedger::Get(const std::string& worker) const {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(worker);
  Outstanding out = it == workers_.end() ? Outstanding{} : it->second.out;
  if (auto c = creations_.find(worker); c != creations_.end()) {
    const absl::Time now = absl::Now();
    for (const auto& [session, creation] : c->second.sessions) {
      out.new_sessions += creation.requests > 0 || creation.until > now ? 1 : 0;
    }
  }
  return out;
}

int DispatchLedger::LeadingPages(const std::string& worker, absl::Span<const BlockHash> chain) const {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(worker);
  auto done = finished_.find(worker);
  const auto* computing = it == workers_.end() ? nullptr : &it->second.pages;
  const auto* until = done == finished_.end() ? nullptr : &done->second.until;
  const absl::Time now = absl::Now();
  auto held = [computing, until, now](const BlockHash& h) {
    if (computing != nullptr && computing->contains(h)) return true;
    if (until == nullptr) return false;
    auto f = until->find(h);
    return f != until->end() && f->second > now;
  };
  int n = 0;
  while (n < static_cast<int>(chain.size()) && held(chain[n])) ++n;
  return n;
}

void DispatchLedger::SessionDispatched(const SessionKey& session, const std::string& worker, bool creates) {
  absl::MutexLock lock(&mu_);
  ++sessions_[session][worker];
  if (creates) ++creations_[worker].sessions[session].requests;
}

void DispatchLedger::SessionFinished(const SessionKey& session, const std::string& worker, bool creates,
                                     bool held) {
  absl::MutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  if (auto c = creations_.find(worker); creates && c != creations_.end()) {
    WorkerCreations& on = c->second;
    // Absent once the directory has listed it.
    if (auto it = on.sessions.find(session); it != on.sessions.end() && --it->second.requests == 0) {
      if (held) {
        it->second.until = now + kFinishedGrace;
      } else {
        on.sessions.erase(it);
      }
    }
    if (on.sessions.size() >= on.purge_at) {  // amortised, as finished_
      absl::erase_if(on.sessions,
                     [now](const auto& e) { return e.second.requests == 0 && e.second.until <= now; });
      on.purge_at = std::max<size_t>(64, 2 * on.sessions.size());
    }
    if (on.sessions.empty()) creations_.erase(c);
  }
  auto it = sessions_.find(session);
  assert(it != sessions_.end());
  if (it == sessions_.end()) return;
  auto w = it->second.find(worker);
  assert(w != it->second.end());
  if (w != it->second.end() && --w->second == 0) it->second.erase(w);
  if (it->second.empty()) sessions_.erase(it);
  if (!held) return;
  recent_sessions_[session] = RecentSession{worker, now + kFinishedGrace};
  if (recent_sessions_.size() >= recent_purge_at_) {
    absl::erase_if(recent_sessions_, [now](const auto& e) { return e.second.until <= now; });
    recent_purge_at_ = std::max<size_t>(1024, 2 * recent_sessions_.size());
  }
}

std::vector<SessionKey> DispatchLedger::Creations(const std::string& worker) const {
  absl::MutexLock lock(&mu_);
  std::vector<SessionKey> out;
  auto c = creations_.find(worker);
  if (c == creations_.end()) return out;
  const absl::Time now = absl::Now();
  for (const auto& [session, creation] : c->second.sessions) {
    if (creation.requests > 0 || creation.until > now) out.push_back(session);
  }
  return out;
}

void DispatchLedger::Listed(const SessionKey& session, const std::string& worker) {
  absl::MutexLock lock(&mu_);
  auto c = creations_.find(worker);
  if (c == creations_.end()) return;
  c->second.sessions.erase(session);
  if (c->second.sessions.empty()) creations_.erase(c);
}

std::optional<std::string> DispatchLedger::SessionWorker(const SessionKey& session) const {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(session);
  if (it == sessions_.end()) return std::nullopt;
  return it->second.begin()->first;
}

std::optional<std::string> DispatchLedger::RecentSessionWorker(const SessionKey& session) const {
  absl::MutexLock lock(&mu_);
  if (auto it = sessions_.find(session); it != sessions_.end()) return it->second.begin()->first;
  auto r = recent_sessions_.find(session);
  if (r == recent_sessions_.end() || r->second.until <= absl::Now()) return std::nullopt;
  return r->second.worker;
}

std::vector<SessionKey> DispatchLedger::RecentSessionsNamed(const std::string& session_id) const {
  absl::MutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  std::vector<SessionKey> out;
  for (const auto& [key, on] : sessions_) {
    if (key.session_id == session_id) out.push_back(key);
  }
  for (const auto& [key, r] : recent_sessions_) {
    if (key.session_id == session_id && r.until > now && !sessions_.contains(key)) out.push_back(key);
  }
  return out;
}

void DispatchLedger::SessionMoved(const SessionKey& session, const std::string& worker) {
  absl::MutexLock lock(&mu_);
  if (auto r = recent_sessions_.find(session); r != recent_sessions_.end()) r->second.worker = worker;
}

void DispatchLedger::SessionClosed(const SessionKey& session) {
  absl::MutexLock lock(&mu_);
  recent_sessions_.erase(session);
  // No longer counted anywhere; a request still creating it ends as usual.
  for (auto& [worker, on] : creations_) {
    if (auto it = on.sessions.find(session); it != on.sessions.end() && it->second.requests == 0) {
      on.sessions.erase(it);
    }
  }
  absl::erase_if(creations_, [](const auto& e) { return e.second.sessions.empty(); });
}

size_t DispatchLedger::sessions_tracked() const {
  absl::MutexLock lock(&mu_);
  return sessions_.size();
}

size_t DispatchLedger::workers_tracked() const {
  absl::MutexLock lock(&mu_);
  size_t n = workers_.size();
  for (const auto& [worker, on] : creations_) {
    const bool in_flight = absl::c_any_of(on.sessions, [](const auto& e) { return e.second.requests > 0; });
    n += !workers_.contains(worker) && in_flight ? 1 : 0;
  }
  return n;
}

}  // namespace kvcache::router
