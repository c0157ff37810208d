#include "tests/bench/fleet_sim.h"

#include <xxhash.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace kvcache::sim {
namespace {

constexpr uint8_t kDevice = 1;
constexpr uint8_t kHost = 2;

uint64_t Mix(uint64_t a, uint64_t b) {
  const uint64_t v[2] = {a, b};
  return XXH3_64bits(v, sizeof(v)) | 1;  // never 0
}

}  // namespace

Fleet::Fleet(FleetConfig config) : config_(config), workers_(config.workers), rng_(config.seed) {
  const int prompt_pages = config_.system_prompt_tokens / config_.page_tokens;
  prompt_keys_.resize(config_.system_prompts);
  for (int p = 0; p < config_.system_prompts; ++p) {
    for (int i = 0; i < prompt_pages; ++i) prompt_keys_[p].push_back(Mix(0x5157e3 + p, i));
  }
}

std::string Fleet::Address(int worker) { return absl::StrFormat("w%04d", worker); }

std::string Fleet::SessionId(int64_t session) const { return absl::StrCat("s", session); }

std::string Fleet::Tenant(int64_t session) const { return absl::StrCat("t", session % 16); }

BlockHash Fleet::HashOfKey(uint64_t key) {
  BlockHash h;
  std::memcpy(h.bytes.data(), &key, sizeof(key));
  for (int i = 1; i < 4; ++i) {
    const uint64_t more = Mix(key, i);
    std::memcpy(h.bytes.data() + 8 * i, &more, sizeof(more));
  }
  return h;
}

uint64_t Fleet::PageKey(const Session& s, int64_t session, int page) const {
  const auto& prompt = prompt_keys_[s.prompt];
  if (page < static_cast<int>(prompt.size())) return prompt[page];
  return Mix(static_cast<uint64_t>(session) + 0x9e3779b97f4a7c15ULL, page);
}

bool Fleet::IsPromptKey(const Session& s, uint64_t key) const {
  const auto& pk = prompt_keys_[s.prompt];
  return std::find(pk.begin(), pk.end(), key) != pk.end();
}

void Fleet::Populate() {
  const int64_t n = config_.sessions;
  sessions_.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    Session& s = sessions_[i];
    s.worker = static_cast<int32_t>(i % config_.workers);
    s.prompt = static_cast<int32_t>(Mix(i, 77) % config_.system_prompts);
    s.tokens = config_.context_tokens;
    workers_[s.worker].sessions.push_back(i);
  }
  const int pages = config_.context_tokens / config_.page_tokens;
  const int64_t capacity = config_.device_blocks + config_.host_blocks;
  for (int w = 0; w < workers(); ++w) {
    Worker& wk = workers_[w];
    // Newest session first: the most recently active hold the tiers.
    std::vector<uint64_t> newest_first;
    for (auto it = wk.sessions.rbegin(); it != wk.sessions.rend(); ++it) {
      Session& s = sessions_[*it];
      std::vector<uint64_t> keys;
      for (int p = 0; p < pages; ++p) {
        const uint64_t k = PageKey(s, *it, p);
        if (!wk.tier.contains(k)) keys.push_back(k);
      }
      if (static_cast<int64_t>(newest_first.size() + keys.size()) > capacity) break;
      for (uint64_t k : keys) {
        wk.tier[k] = static_cast<int64_t>(newest_first.size()) < config_.device_blocks ? kDevice : kHost;
        newest_first.push_back(k);
      }
      s.offloaded = wk.tier[PageKey(s, *it, pages - 1)] == kHost;
    }
    for (auto it = newest_first.rbegin(); it != newest_first.rend(); ++it) {
      if (wk.tier[*it] == kDevice) {
        wk.device_fifo.push_back(*it);
        ++wk.device_n;
      } else {
        wk.host_fifo.push_back(*it);
        ++wk.host_n;
      }
    }
  }
}

void Fleet::Emit(int w, v1::WatchEvent ev, StepStats* st) {
  ++st->messages;
  if (ev.has_event()) st->block_ops += ev.event().block_hashes_size();
  workers_[w].outbox.push_back(std::move(ev));
}

v1::WatchEvent Fleet::PrefixEvent(v1::CacheEvent::Kind kind, v1::Tier tier,
                                  const std::vector<uint64_t>& keys) const {
  v1::WatchEvent ev;
  v1::CacheEvent* e = ev.mutable_event();
  e->set_kind(kind);
  e->set_tier(tier);
  for (uint64_t k : keys) {
    const BlockHash h = HashOfKey(k);
    e->add_block_hashes(h.bytes.data(), h.bytes.size());
  }
  return ev;
}

v1::WatchEvent Fleet::SessionEvent(v1::CacheEvent::Kind kind, int64_t session) const {
  v1::WatchEvent ev;
  v1::CacheEvent* e = ev.mutable_event();
  e->set_kind(kind);
  e->set_session_id(SessionId(session));
  e->set_tenant(Tenant(session));
  e->set_tokens(sessions_[session].tokens);
  e->set_tier(kind == v1::CacheEvent::SESSION_OFFLOADED ? v1::TIER_HOST : v1::TIER_DEVICE);
  return ev;
}

void Fleet::Evict(int w, StepStats* st) {
  Worker& wk = workers_[w];
  std::vector<uint64_t> moved, dropped;
  while (wk.device_n > config_.device_blocks && !wk.device_fifo.empty()) {
    const uint64_t k = wk.device_fifo.front();
    wk.device_fifo.pop_front();
    auto it = wk.tier.find(k);
    if (it == wk.tier.end() || it->second != kDevice) continue;  // stale
    it->second = kHost;
    --wk.device_n;
    ++wk.host_n;
    wk.host_fifo.push_back(k);
    moved.push_back(k);
  }
  while (wk.host_n > config_.host_blocks && !wk.host_fifo.empty()) {
    const uint64_t k = wk.host_fifo.front();
    wk.host_fifo.pop_front();
    auto it = wk.tier.find(k);
    if (it == wk.tier.end() || it->second != kHost) continue;  // stale
    wk.tier.erase(it);
    --wk.host_n;
    dropped.push_back(k);
  }
  if (!moved.empty()) {
    Emit(w, PrefixEvent(v1::CacheEvent::PREFIX_REMOVED, v1::TIER_DEVICE, moved), st);
    Emit(w, PrefixEvent(v1::CacheEvent::PREFIX_STORED, v1::TIER_HOST, moved), st);
  }
  if (!dropped.empty()) Emit(w, PrefixEvent(v1::CacheEvent::PREFIX_REMOVED, v1::TIER_HOST, dropped), st);
}

void Fleet::StoreDevice(int w, const std::vector<uint64_t>& keys, StepStats* st) {
  Worker& wk = workers_[w];
  std::vector<uint64_t> restored, stored;
  for (uint64_t k : keys) {
    auto [it, inserted] = wk.tier.try_emplace(k, kDevice);
    if (!inserted && it->second == kDevice) continue;
    if (!inserted) {  // in tier 1: restored
      it->second = kDevice;
      --wk.host_n;
      restored.push_back(k);
    }
    ++wk.device_n;
    wk.device_fifo.push_back(k);
    stored.push_back(k);
  }
  wk.stored_total += static_cast<int64_t>(stored.size());
  if (!restored.empty()) Emit(w, PrefixEvent(v1::CacheEvent::PREFIX_REMOVED, v1::TIER_HOST, restored), st);
  const size_t chunk = std::max(1, config_.prefill_event_blocks);
  for (size_t i = 0; i < stored.size(); i += chunk) {
    std::vector<uint64_t> part(stored.begin() + i, stored.begin() + std::min(stored.size(), i + chunk));
    Emit(w, PrefixEvent(v1::CacheEvent::PREFIX_STORED, v1::TIER_DEVICE, part), st);
  }
  Evict(w, st);
}

void Fleet::MoveToHost(int w, const std::vector<uint64_t>& keys, StepStats* st) {
  Worker& wk = workers_[w];
  std::vector<uint64_t> moved;
  for (uint64_t k : keys) {
    auto it = wk.tier.find(k);
    if (it == wk.tier.end() || it->second != kDevice) continue;
    it->second = kHost;
    --wk.device_n;
    ++wk.host_n;
    wk.host_fifo.push_back(k);
    moved.push_back(k);
  }
  if (!moved.empty()) {
    Emit(w, PrefixEvent(v1::CacheEvent::PREFIX_REMOVED, v1::TIER_DEVICE, moved), st);
    Emit(w, PrefixEvent(v1::CacheEvent::PREFIX_STORED, v1::TIER_HOST, moved), st);
  }
  Evict(w, st);
}

void Fleet::RemoveKeys(int w, const std::vector<uint64_t>& keys, StepStats* st) {
  Worker& wk = workers_[w];
  std::vector<uint64_t> device, host;
  for (uint64_t k : keys) {
    auto it = wk.tier.find(k);
    if (it == wk.tier.end()) continue;
    if (it->second == kDevice) {
      --wk.device_n;
      device.push_back(k);
    } else {
      --wk.host_n;
      host.push_back(k);
    }
    wk.tier.erase(it);
  }
  if (!device.empty()) Emit(w, PrefixEvent(v1::CacheEvent::PREFIX_REMOVED, v1::TIER_DEVICE, device), st);
  if (!host.empty()) Emit(w, PrefixEvent(v1::CacheEvent::PREFIX_REMOVED, v1::TIER_HOST, host), st);
}

std::vector<uint64_t> Fleet::CachedKeys(int64_t session) const {
  const Session& s = sessions_[session];
  std::vector<uint64_t> out;
  if (s.worker < 0) return out;
  const Worker& wk = workers_[s.worker];
  for (int p = 0; p < s.tokens / config_.page_tokens; ++p) {
    const uint64_t k = PageKey(s, session, p);
    if (wk.tier.contains(k)) out.push_back(k);
  }
  return out;
}

int64_t Fleet::PickSession(int w) {
  const auto& list = workers_[w].sessions;
  if (list.empty()) return -1;
  // Activity is skewed: half the operations go to the most recent sixteenth of
  // the worker's sessions (their pages are the ones still cached).
  const size_t hot = std::max<size_t>(1, list.size() / 16);
  const size_t i = (rng_() & 1) ? list.size() - 1 - rng_() % hot : rng_() % list.size();
  return list[i];
}

void Fleet::Decode(int64_t id, StepStats* st) {
  Session& s = sessions_[id];
  const int page = s.tokens / config_.page_tokens;
  s.tokens += config_.page_tokens;
  StoreDevice(s.worker, {PageKey(s, id, page)}, st);
}

void Fleet::Turn(int64_t id, StepStats* st) {
  Session& s = sessions_[id];
  const int w = s.worker;
  if (s.offloaded) {
    s.offloaded = false;
    Emit(w, SessionEvent(v1::CacheEvent::SESSION_RESTORED, id), st);
  }
  // The whole context is (re)stored: cached pages are hits (no event), pages
  // in tier 1 are restored, missing ones recomputed; then the new turn.
  s.tokens += config_.turn_tokens;
  std::vector<uint64_t> keys;
  for (int p = 0; p < s.tokens / config_.page_tokens; ++p) keys.push_back(PageKey(s, id, p));
  StoreDevice(w, keys, st);
}

void Fleet::CloseAndOpen(int64_t id, StepStats* st) {
  Session& s = sessions_[id];
  const int w = s.worker;
  Emit(w, SessionEvent(v1::CacheEvent::SESSION_DROPPED, id), st);
  auto& list = workers_[w].sessions;
  list.erase(std::find(list.begin(), list.end(), id));
  s.worker = -1;
  // A new session on a random worker, with a random system prompt.
  const int64_t n = static_cast<int64_t>(sessions_.size());
  Session fresh;
  fresh.worker = static_cast<int32_t>(rng_() % workers());
  fresh.prompt = static_cast<int32_t>(rng_() % config_.system_prompts);
  fresh.tokens = config_.system_prompt_tokens + config_.turn_tokens;
  sessions_.push_back(fresh);
  workers_[fresh.worker].sessions.push_back(n);
  Emit(fresh.worker, SessionEvent(v1::CacheEvent::SESSION_PLACED, n), st);
  std::vector<uint64_t> keys;
  for (int p = 0; p < fresh.tokens / config_.page_tokens; ++p) keys.push_back(PageKey(fresh, n, p));
  StoreDevice(fresh.worker, keys, st);
}

void Fleet::Offload(int64_t id, StepStats* st) {
  Session& s = sessions_[id];
  if (s.offloaded) return;
  s.offloaded = true;
  Emit(s.worker, SessionEvent(v1::CacheEvent::SESSION_OFFLOADED, id), st);
  std::vector<uint64_t> keys = CachedKeys(id);
  // Shared system-prompt pages stay in tier 0 (other sessions use them).
  keys.erase(std::remove_if(keys.begin(), keys.end(), [&](uint64_t k) { return IsPromptKey(s, k); }),
             keys.end());
  MoveToHost(s.worker, keys, st);
}

void Fleet::Migrate(int64_t id, int to, StepStats* st) {
  Session& s = sessions_[id];
  const int from = s.worker;
  if (from == to) return;
  std::vector<uint64_t> keys = CachedKeys(id);
  v1::WatchEvent exported = SessionEvent(v1::CacheEvent::SESSION_EXPORTED, id);
  exported.mutable_event()->set_target_worker(Address(to));
  Emit(from, std::move(exported), st);
  std::vector<uint64_t> own;  // the source keeps the shared system prompt
  for (uint64_t k : keys) {
    if (!IsPromptKey(s, k)) own.push_back(k);
  }
  RemoveKeys(from, own, st);
  auto& list = workers_[from].sessions;
  list.erase(std::find(list.begin(), list.end(), id));
  s.worker = to;
  s.offloaded = false;
  workers_[to].sessions.push_back(id);
  Emit(to, SessionEvent(v1::CacheEvent::SESSION_PLACED, id), st);
  StoreDevice(to, keys, st);
  MaybeReportLoad(from, st);
}

void Fleet::MaybeReportLoad(int w, StepStats* st) {
  if (++workers_[w].ops % std::max(1, config_.load_report_every) != 0) return;
  v1::WatchEvent ev;
  *ev.mutable_load() = Load(w);
  Emit(w, std::move(ev), st);
}

StepStats Fleet::Step() {
  StepStats st;
  const int w = static_cast<int>(rng_() % workers());
  const int64_t id = PickSession(w);
  if (id < 0) return st;
  const uint32_t r = rng_() % 100;
  if (r < 80) {
    Decode(id, &st);
  } else if (r < 88) {
    Turn(id, &st);
  } else if (r < 92) {
    CloseAndOpen(id, &st);
  } else if (r < 96) {
    Offload(id, &st);
  } else if (r < 98) {
    Turn(id, &st);  // typically of an offloaded session: a restore
  } else {
    Migrate(id, static_cast<int>(rng_() % workers()), &st);
  }
  MaybeReportLoad(w, &st);
  return st;
}

StepStats Fleet::DecodeStep() {
  StepStats st;
  const int w = static_cast<int>(rng_() % workers());
  const int64_t id = PickSession(w);
  if (id < 0) return st;
  Decode(id, &st);
  MaybeReportLoad(w, &st);
  return st;
}

std::vector<v1::WatchEvent> Fleet::TakeOutbox(int worker) {
  std::vector<v1::WatchEvent> out;
  out.swap(workers_[worker].outbox);
  return out;
}

void Fleet::ClearOutboxes() {
  for (Worker& w : workers_) w.outbox.clear();
}

v1::WorkerLoad Fleet::Load(int worker, int64_t extra_requests) const {
  const Worker& wk = workers_[worker];
  v1::WorkerLoad load;
  load.set_pages_total_device(config_.device_blocks);
  load.set_pages_free_device(std::max<int64_t>(0, config_.device_blocks - wk.device_n));
  load.set_pages_total_host(config_.host_blocks);
  load.set_pages_free_host(std::max<int64_t>(0, config_.host_blocks - wk.host_n));
  load.set_running_requests(static_cast<int32_t>(extra_requests));
  load.set_sessions(static_cast<int32_t>(wk.sessions.size()));
  load.set_prefill_tokens_per_second(20000);
  return load;
}

std::vector<v1::WatchEvent> Fleet::Snapshot(int worker) const {
  const Worker& wk = workers_[worker];
  std::vector<v1::WatchEvent> parts(1);
  v1::WorkerSnapshot* snap = parts.back().mutable_snapshot();
  snap->set_worker_id(Address(worker));
  snap->set_model_id("sim-model");
  snap->mutable_kv_shape()->set_page_tokens(config_.page_tokens);
  *snap->mutable_load() = Load(worker);
  for (int64_t id : wk.sessions) {
    const Session& s = sessions_[id];
    v1::SessionInfo* info = snap->add_sessions();
    info->set_session_id(SessionId(id));
    info->set_tenant(Tenant(id));
    info->set_state(s.offloaded ? v1::SESSION_OFFLOADED : v1::SESSION_IDLE);
    info->set_tokens_cached(s.tokens);
  }
  int in_part = 0;
  for (const auto& [k, t] : wk.tier) {
    if (in_part == config_.snapshot_part_hashes) {
      snap->set_more(true);
      parts.emplace_back();
      snap = parts.back().mutable_snapshot();
      in_part = 0;
    }
    const BlockHash h = HashOfKey(k);
    if (t == kDevice) {
      snap->add_device_block_hashes(h.bytes.data(), h.bytes.size());
    } else {
      snap->add_host_block_hashes(h.bytes.data(), h.bytes.size());
    }
    ++in_part;
  }
  return parts;
}

std::vector<BlockHash> Fleet::NewRequestChain(int prompt, int private_pages, uint64_t salt) const {
  std::vector<BlockHash> chain;
  for (uint64_t k : prompt_keys_[prompt % config_.system_prompts]) chain.push_back(HashOfKey(k));
  for (int i = 0; i < private_pages; ++i) chain.push_back(HashOfKey(Mix(salt ^ 0xfeed, i)));
  return chain;
}

std::vector<BlockHash> Fleet::SessionChain(int64_t session) const {
  const Session& s = sessions_[session];
  std::vector<BlockHash> chain;
  for (int p = 0; p < s.tokens / config_.page_tokens; ++p) chain.push_back(HashOfKey(PageKey(s, session, p)));
  return chain;
}

int64_t Fleet::cached_entries() const {
  int64_t n = 0;
  for (const Worker& w : workers_) n += static_cast<int64_t>(w.tier.size());
  return n;
}

void WatchStream::Number(std::vector<v1::WatchEvent>* messages) {
  for (v1::WatchEvent& m : *messages) m.set_sequence(next_++);
}

SimRouter::SimRouter(int workers) : workers_(workers) {
  ingest_.reserve(workers);
  for (int w = 0; w < workers; ++w) {
    names_.push_back(Fleet::Address(w));
    ingest_.emplace_back(&directory_, names_.back());
  }
}

absl::Status SimRouter::Deliver(int worker, v1::WatchEvent* message) {
  return ingest_[worker].Ingest(message).status();
}

namespace {
double MicrosSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

absl::StatusOr<router::Placement> SimRouter::Place(const std::string& session_id, const std::string& tenant,
                                                   absl::Span<const BlockHash> chain, int page_tokens,
                                                   Timing* timing) {
  auto t0 = std::chrono::steady_clock::now();
  const std::optional<router::SessionLocation> loc = directory_.FindSession({tenant, session_id});
  const auto matches = directory_.MatchPrefix(chain);
  const auto session_counts = directory_.SessionCounts();
  if (timing != nullptr) timing->match_us += MicrosSince(t0);
  t0 = std::chrono::steady_clock::now();
  std::vector<router::Candidate> candidates;
  candidates.reserve(workers_);
  for (const router::WorkerId& w : names_) {
    std::optional<v1::WorkerLoad> load = directory_.Load(w);
    if (!load.has_value()) continue;  // not heard from yet
    router::Candidate c;
    c.worker = w;
    c.load = *std::move(load);
    const router::DispatchLedger::Outstanding out = ledger_.Get(w);
    c.dispatched_requests = out.requests;
    c.dispatched_prefill_tokens = out.prefill_tokens;
    if (auto m = matches.find(w); m != matches.end()) c.match = m->second;
    const int computing = ledger_.LeadingPages(w, chain);
    if (computing > c.match.total_pages()) c.match = router::PrefixMatch{computing, 0};
    c.sessions = out.new_sessions;
    if (auto n = session_counts.find(w); n != session_counts.end()) c.sessions += n->second;
    candidates.push_back(std::move(c));
  }
  if (timing != nullptr) timing->candidates_us += MicrosSince(t0);
  t0 = std::chrono::steady_clock::now();
  auto placed = router::Choose(config_, session_id, loc.has_value() ? loc->worker : router::WorkerId(),
                               page_tokens, static_cast<int>(chain.size()),
                               /*new_session=*/!session_id.empty(), candidates, /*retry=*/false);
  if (timing != nullptr) timing->choose_us += MicrosSince(t0);
  return placed;
}

}  // namespace kvcache::sim
