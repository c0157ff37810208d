// A fleet of simulated workers for the router: no model, only what a worker's
// Watch stream says (snapshots in parts, cache events, load reports), from
// synthetic sessions and block hashes, so that one router can be driven by a
// thousand workers and a million sessions on one machine.
//
// The model (stated in router_scale.json's notes and in deploy/README.md,
// "Router fleet at scale"):
//  - every worker caches at most `device_blocks` pages in tier 0 and
//    `host_blocks` in tier 1 (its HBM and host-RAM budgets); a page pushed out
//    of tier 0 goes to tier 1, one pushed out of tier 1 is dropped, in
//    insertion order (FIFO, which moves at least as many pages as LRU would);
//  - a session's context is a shared system prompt (one of `system_prompts`,
//    `system_prompt_tokens` long, hashed once per prompt, so sessions with the
//    same prompt share its pages) followed by private pages; at the start each
//    session holds `context_tokens`, of which only the most recently active
//    sessions' pages still fit in a worker's tiers (the others are truncated to
//    0 cached tokens, and stay in the session table);
//  - churn (Step): a decode step stores one page (every 16 tokens), a new turn
//    prefills `turn_tokens`, sessions close and open, idle sessions are
//    offloaded and restored, sessions migrate between workers, and each worker
//    reports its load now and then. Every operation emits the cache events a
//    real worker would (with the evictions it causes).
// Block hashes are 32 bytes whose first 8 are a 64-bit key unique to (session,
// page) or (system prompt, page).
//
// The simulator is the ground truth: Snapshot(w) is what worker w holds now.
// Messages carry no sequence numbers; a WatchStream numbers them per
// subscriber, as each real Watch stream does.
//
// Thread-safety: none; drive a fleet from one thread.
#ifndef KVCACHE_TESTS_BENCH_FLEET_SIM_H_
#define KVCACHE_TESTS_BENCH_FLEET_SIM_H_

#include <cstdint>
#include <deque>
#include <random>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/block_hash.h"
#include "kvcache/v1/worker.pb.h"
#include "router/directory.h"
#include "router/dispatch_ledger.h"
#include "router/placement.h"
#include "router/watch_ingest.h"

namespace kvcache::sim {

struct FleetConfig {
  int workers = 8;
  int64_t sessions = 1000;
  int context_tokens = 8000;
  int page_tokens = 16;
  int64_t device_blocks = 4096;  // per worker
  int64_t host_blocks = 12288;   // per worker
  int system_prompts = 64;
  int system_prompt_tokens = 1024;
  int turn_tokens = 256;            // prefill of a new turn
  int prefill_event_blocks = 32;    // pages per PREFIX_STORED event of a prefill
  int snapshot_part_hashes = 8192;  // hashes per snapshot part
  int load_report_every = 64;       // a worker reports its load every N operations on it
  uint64_t seed = 1;
};

// What Step did, for the benchmark's accounting.
struct StepStats {
  int64_t messages = 0;   // Watch messages emitted
  int64_t block_ops = 0;  // page hashes in them (stored or removed)
};

class Fleet {
 public:
  explicit Fleet(FleetConfig config);

  const FleetConfig& config() const { return config_; }
  int workers() const { return static_cast<int>(workers_.size()); }
  static std::string Address(int worker);  // "w0007": also the directory's worker id

  // Builds the steady state directly (no events): sessions spread over workers,
  // each worker's tiers filled by its most recent sessions. Call once.
  void Populate();
  // One random operation; its messages go to the workers' outboxes.
  StepStats Step();
  // One decode step that fills a page, on a random worker: one page stored,
  // and the evictions it causes (each of those a one-page event too).
  StepStats DecodeStep();
  // Messages emitted by `worker` since the last call.
  std::vector<v1::WatchEvent> TakeOutbox(int worker);
  // Drops every outbox (a benchmark that fed nothing from them).
  void ClearOutboxes();
  // What `worker` holds now, as a Watch stream's opening snapshot: parts of at
  // most snapshot_part_hashes hashes, all but the last with more = true.
  std::vector<v1::WatchEvent> Snapshot(int worker) const;
  // A load report of `worker` as it would send one, with `extra_requests`
  // added to its running requests (requests routers dispatched to it).
  v1::WorkerLoad Load(int worker, int64_t extra_requests = 0) const;

  // Chain of page hashes a new request with system prompt `prompt` and
  // `private_pages` new pages would have (the private pages are new to the
  // fleet). For placement measurements.
  std::vector<BlockHash> NewRequestChain(int prompt, int private_pages, uint64_t salt) const;
  // Chain of a live session's cached context.
  std::vector<BlockHash> SessionChain(int64_t session) const;
  int64_t session_count() const { return static_cast<int64_t>(sessions_.size()); }
  std::string SessionId(int64_t session) const;
  std::string Tenant(int64_t session) const;
  int WorkerOf(int64_t session) const { return sessions_[session].worker; }
  int PromptOf(int64_t session) const { return sessions_[session].prompt; }

  // Pages cached across the fleet, counting each (page, worker) once.
  int64_t cached_entries() const;

  static BlockHash HashOfKey(uint64_t key);

 private:
  struct Session {
    int32_t worker = -1;  // -1: closed
    int32_t prompt = 0;
    int32_t tokens = 0;        // context length
    int32_t cached_pages = 0;  // leading pages held (system prompt + private)
    bool offloaded = false;
  };
  struct Worker {
    absl::flat_hash_map<uint64_t, uint8_t> tier;  // page key -> 1 device, 2 host
    std::deque<uint64_t> device_fifo, host_fifo;  // may hold stale keys (checked on pop)
    int64_t device_n = 0, host_n = 0;
    std::vector<int64_t> sessions;  // ids of sessions placed here (may hold closed ones)
    std::vector<v1::WatchEvent> outbox;
    int64_t ops = 0;
    int64_t stored_total = 0;
  };

  uint64_t PageKey(const Session& s, int64_t session, int page) const;
  bool IsPromptKey(const Session& s, uint64_t key) const;
  void Emit(int w, v1::WatchEvent ev, StepStats* st);
  v1::WatchEvent PrefixEvent(v1::CacheEvent::Kind kind, v1::Tier tier,
                             const std::vector<uint64_t>& keys) const;
  v1::WatchEvent SessionEvent(v1::CacheEvent::Kind kind, int64_t session) const;
  // Stores `keys` in w's tier 0 (restoring any in tier 1), evicting as needed,
  // and emits the events, `prefill_event_blocks` hashes per event.
  void StoreDevice(int w, const std::vector<uint64_t>& keys, StepStats* st);
  // Moves w's cached `keys` to tier 1 (offload), evicting as needed.
  void MoveToHost(int w, const std::vector<uint64_t>& keys, StepStats* st);
  void RemoveKeys(int w, const std::vector<uint64_t>& keys, StepStats* st);
  void Evict(int w, StepStats* st);
  std::vector<uint64_t> CachedKeys(int64_t session) const;
  int64_t PickSession(int w);
  void Decode(int64_t s, StepStats* st);
  void Turn(int64_t s, StepStats* st);
  void CloseAndOpen(int64_t s, StepStats* st);
  void Offload(int64_t s, StepStats* st);
  void Migrate(int64_t s, int to, StepStats* st);
  void MaybeReportLoad(int w, StepStats* st);

  FleetConfig config_;
  std::vector<Worker> workers_;
  std::vector<Session> sessions_;
  std::vector<std::vector<uint64_t>> prompt_keys_;  // by system prompt
  std::mt19937_64 rng_;
};

// Numbers one subscriber's Watch stream from a worker: a stream opens with the
// worker's snapshot at sequence 1 and numbers every later message.
class WatchStream {
 public:
  // Numbers `messages` in place.
  void Number(std::vector<v1::WatchEvent>* messages);
  void Restart() { next_ = 1; }

 private:
  uint64_t next_ = 1;
};

// One router replica as the simulation needs it: the router's own Directory,
// one WatchIngest per worker stream, its DispatchLedger, and placement as
// RouterService::Place does it (affinity, then prefix match, load and the
// ledger's in-flight work, scored by router::Choose).
class SimRouter {
 public:
  explicit SimRouter(int workers);

  router::Directory& directory() { return directory_; }
  router::DispatchLedger& ledger() { return ledger_; }
  router::WatchIngest& ingest(int worker) { return ingest_[worker]; }

  // Feeds one numbered message of `worker`'s stream. DATA_LOSS on a gap (then
  // the caller resyncs: Resync(), and a new stream's snapshot).
  absl::Status Deliver(int worker, v1::WatchEvent* message);

  // Where a request goes. `chain`: its prompt's page hashes. Time spent is
  // added to the Timing fields when given.
  struct Timing {
    double match_us = 0;       // Directory::MatchPrefix and SessionCounts
    double candidates_us = 0;  // loads, ledger and matches per worker
    double choose_us = 0;      // router::Choose
  };
  absl::StatusOr<router::Placement> Place(const std::string& session_id, const std::string& tenant,
                                          absl::Span<const BlockHash> chain, int page_tokens,
                                          Timing* timing = nullptr);

 private:
  int workers_;
  router::Directory directory_;
  router::DispatchLedger ledger_;
  std::vector<router::WatchIngest> ingest_;
  std::vector<router::WorkerId> names_;
  router::PlacementConfig config_;
};

}  // namespace kvcache::sim

#endif  // KVCACHE_TESTS_BENCH_FLEET_SIM_H_
