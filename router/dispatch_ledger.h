// DispatchLedger: what this router has sent each worker and not yet seen finish.
//
// The directory is built from the workers' own reports, which trail a dispatch
// by a report interval (load) or by the request's prefill (cache events). In a
// burst, every placement in between would see the same idle worker and the same
// uncached prefix. The ledger closes that gap with this router's own knowledge,
// counted at once: requests in flight per worker, the prompt tokens it expects
// them still to prefill, and the prefix pages they are computing there (so a
// second request with the same new prefix counts it as cached where the first
// went: the worker's engine computes a prefix shared by concurrent requests
// once). Entries leave when the request ends; by then the worker's own reports
// cover them.
//
// Unlike the directory, the ledger is per router: replicas do not share it.
//
// Thread-safety: all methods take an internal lock; safe from any thread.
#ifndef KVCACHE_ROUTER_DISPATCH_LEDGER_H_
#define KVCACHE_ROUTER_DISPATCH_LEDGER_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/block_hash.h"
#include "router/directory.h"

namespace kvcache::router {

class DispatchLedger {
 public:
  struct Outstanding {
    int64_t requests = 0;
    int64_t prefill_tokens = 0;
    // Sessions those requests are creating there (the directory hears of a
    // session only when its first request has prefilled).
    int64_t new_sessions = 0;
  };

  // A request was sent to `worker`: `prefill_tokens` of its prompt are expected
  // to be computed there, and `chain` (its prompt's full-page hashes) will be
  // cached there. Pair with Finish (same worker, chain and what is left of the
  // prefill tokens).
  void Dispatch(const std::string& worker, absl::Span<const BlockHash> chain, int64_t prefill_tokens);
  // The request's prompt is computed (its first token arrived).
  void PrefillDone(const std::string& worker, int64_t prefill_tokens);
  // `computed`: the request ended OK, so its pages are cached on `worker`. They
  // count there (LeadingPages) for kFinishedGrace more: the worker sent their
  // cache events before the reply, but the router applies them on another
  // thread, a moment after the reply may have reached the client.
  void Finish(const std::string& worker, absl::Span<const BlockHash> chain, int64_t prefill_tokens,
              bool computed = false);
  static constexpr absl::Duration kFinishedGrace = absl::Seconds(2);

  // Named sessions: a request on `session` was sent to `worker` / ended there.
  // While one is in flight, SessionWorker names its worker, and placement sends
  // the session's next request there too (whatever the placement mode): the
  // worker refuses a second request on a busy session with ABORTED, so that two
  // concurrent first requests on a new id never create it on two workers.
  // `creates`: the request makes the session on `worker` (a new session, or a
  // FULL_CONTEXT turn that moves it there). `held`: the request left the
  // session on `worker` (it ended OK, or sent a token before it failed). Pair
  // each call with SessionFinished with the same session, worker and `creates`.
  //
  // A session being created counts in Get's new_sessions until the directory
  // lists it on its worker (the worker's event trails the dispatch: placement
  // polls Creations and reports Listed), so that it counts once, as the
  // ledger's and then as the directory's; one that ended held, unlisted, goes
  // on counting for kFinishedGrace.
  void SessionDispatched(const SessionKey& session, const std::string& worker, bool creates);
  void SessionFinished(const SessionKey& session, const std::string& worker, bool creates, bool held);
  // The sessions being created on `worker` that count there now.
  std::vector<SessionKey> Creations(const std::string& worker) const;
  // The directory lists `session` on `worker`: it no longer counts as a creation.
  void Listed(const SessionKey& session, const std::string& worker);
  std::optional<std::string> SessionWorker(const SessionKey& session) const;
  // The worker a request on `session` is in flight on, or where one left it in
  // the last kFinishedGrace (the worker's placement event may not have reached
  // the directory yet): where the session lives as far as this router knows.
  std::optional<std::string> RecentSessionWorker(const SessionKey& session) const;
  // Every tenant's session with this id in flight or recently left (as
  // RecentSessionWorker): for admin calls, which name a session by id alone.
  std::vector<SessionKey> RecentSessionsNamed(const std::string& session_id) const;
  // The session was closed through this router: it lives nowhere now.
  void SessionClosed(const SessionKey& session);
  // A migration moved `session` to `worker`: RecentSessionWorker names that
  // worker now where it named the one the session left.
  void SessionMoved(const SessionKey& session, const std::string& worker);

  Outstanding Get(const std::string& worker) const;
  // Leading pages of `chain` that requests in flight on `worker` are computing.
  int LeadingPages(const std::string& worker, absl::Span<const BlockHash> chain) const;
  // Workers with anything outstanding, and sessions in flight (for leak tests).
  size_t workers_tracked() const;
  size_t sessions_tracked() const;

 private:
  struct PerWorker {
    Outstanding out;
    absl::flat_hash_map<BlockHash, int> pages;  // hash -> requests computing it
  };

  struct Finished {
    absl::flat_hash_map<BlockHash, absl::Time> until;  // page -> end of its grace
    size_t purge_at = 1024;                            // size that triggers the next purge
  };

  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, PerWorker> workers_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, Finished> finished_ ABSL_GUARDED_BY(mu_);
  // session -> worker -> requests in flight there (one worker but in a race).
  absl::flat_hash_map<SessionKey, absl::flat_hash_map<std::string, int>> sessions_ ABSL_GUARDED_BY(mu_);
  // Sessions being created on a worker that the directory does not list there
  // yet: requests in flight creating it, and once none is, until when it counts.
  struct Creation {
    int requests = 0;
    absl::Time until = absl::InfinitePast();
  };
  struct WorkerCreations {
    absl::flat_hash_map<SessionKey, Creation> sessions;
    size_t purge_at = 64;  // size that triggers the next purge of expired entries
  };
  absl::flat_hash_map<std::string, WorkerCreations> creations_ ABSL_GUARDED_BY(mu_);

  struct RecentSession {
    std::string worker;
    absl::Time until;
  };
  // Sessions whose last request here ended within kFinishedGrace (purged as
  // finished_ is).
  absl::flat_hash_map<SessionKey, RecentSession> recent_sessions_ ABSL_GUARDED_BY(mu_);
  size_t recent_purge_at_ ABSL_GUARDED_BY(mu_) = 1024;
};

}  // namespace kvcache::router

#endif  // KVCACHE_ROUTER_DISPATCH_LEDGER_H_
