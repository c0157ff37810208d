// The public API (kvcache.v1.KvCache) and the operator API
// (kvcache.v1.KvCacheAdmin) of the router.
//
// Generate: authenticate (tenant), tokenise the input with the model's
// tokenizer (the same rule the workers use: common/input_tokens.h), hash its
// full pages (common/block_hash.h, salted by tenant), place it (session
// affinity, then tier-aware prefix reuse against load under a bounded-load cap;
// or round-robin / random for comparison), and proxy the worker's stream. A
// FULL_CONTEXT request refused before its first token (RESOURCE_EXHAUSTED,
// UNAVAILABLE) tries the next-best worker; one whose worker is lost mid-stream
// continues on another worker from the tokens the client already has (prompt +
// streamed tokens as the new input), so the client sees one stream without
// duplicated tokens. An APPEND cut after tokens with its session kept (out of
// KV memory mid-reply, its worker's drain deadline) follows the session to the
// worker it moves to and goes on the reply there (continued_tokens), so its
// client too sees one stream. An APPEND request whose worker is lost fails
// with UNAVAILABLE naming the session.
//
// Threads: none per request. Generate proxies the worker's stream through gRPC's
// callback client API, so a live stream is two reactors and no thread; calls to
// workers on behalf of session and admin calls are callback unary calls. The
// only step that blocks (an APPEND or session call waiting up to
// `session_lookup_wait` for a session the directory has not heard of yet, or up
// to `drain_move_wait` for a session on a draining worker to move) runs on an
// executor whose threads start as waits need them, up to `executor_threads`.
// Rebalancing and evacuation have a thread each.
//
// Thread-safety: handlers and callbacks run on gRPC and executor threads; shared
// state is in the thread-safe directory, pool and metrics, and the service's own
// under its mutex.
#ifndef KVCACHE_ROUTER_ROUTER_SERVICE_H_
#define KVCACHE_ROUTER_ROUTER_SERVICE_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/functional/any_invocable.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/tokenizer/chat_template.h"
#include "common/tokenizer/tokenizer.h"
#include "kvcache/v1/router.grpc.pb.h"
#include "router/auth.h"
#include "router/directory.h"
#include "router/dispatch_ledger.h"
#include "router/executor.h"
#include "router/placement.h"
#include "router/router_metrics.h"
#include "router/worker_pool.h"

namespace kvcache::router {

enum class PlacementMode { kAffinity, kRoundRobin, kRandom };
absl::StatusOr<PlacementMode> ParsePlacementMode(const std::string& s);

struct RouterOptions {
  PlacementMode mode = PlacementMode::kAffinity;
  PlacementConfig placement;
  int max_attempts = 3;  // workers tried per request
  // How long an APPEND waits for its session to appear in the directory.
  absl::Duration session_lookup_wait = absl::Seconds(1);
  // How long an APPEND to a session on a draining worker waits for the session
  // to be migrated elsewhere before it is tried where it is.
  absl::Duration drain_move_wait = absl::Seconds(10);
  // How often the router looks for draining workers to evacuate, and for stale
  // copies of sessions to close (Directory::TakeStaleCopies).
  absl::Duration evacuate_interval = absl::Milliseconds(250);
  // Rebalancing: every `rebalance_interval` (0 disables), move idle sessions off
  // a worker whose free device pages fell under `rebalance_low_free` of capacity
  // to one with more than `rebalance_high_free`, at most `rebalance_batch` per
  // round, and only sessions of at least `rebalance_min_tokens` (smaller ones
  // are cheaper to recompute than to move).
  absl::Duration rebalance_interval = absl::Seconds(5);
  double rebalance_low_free = 0.10;
  double rebalance_high_free = 0.50;
  int rebalance_batch = 4;
  int rebalance_min_tokens = 64;
  // The executor for the waits above: the most threads it starts (as waits
  // need them; a wait is mostly idle), and how many waits may queue for them
  // before a request is refused with RESOURCE_EXHAUSTED.
  int executor_threads = 64;
  size_t executor_max_queued = 4096;
};

class RouterService final : public v1::KvCache::CallbackService {
 public:
  // All pointers must outlive the service. `chat_template` may be null.
  RouterService(RouterOptions options, WorkerPool* pool, Directory* directory,
                const tok::Tokenizer* tokenizer, const tok::ChatTemplate* chat_template,
                const Authenticator* auth, RouterMetrics* metrics);
  ~RouterService() override;  // Shutdown()

  // Ends the rebalancer and the evacuator, refuses new calls (UNAVAILABLE),
  // waits until every call in flight has answered, and joins the executor.
  void Shutdown();
  // From now on new calls get UNAVAILABLE "router is shutting down"; calls in
  // flight go on. For the start of a shutdown, before the workers are let go
  // (a call would otherwise find no worker and say so).
  void RefuseNewCalls();

  grpc::ServerWriteReactor<v1::GenerateResponse>* Generate(grpc::CallbackServerContext* context,
                                                           const v1::GenerateRequest* request) override;
  grpc::ServerUnaryReactor* GetSession(grpc::CallbackServerContext* context,
                                       const v1::SessionRequest* request, v1::SessionInfo* response) override;
  grpc::ServerUnaryReactor* CloseSession(grpc::CallbackServerContext* context,
                                         const v1::SessionRequest* request,
                                         v1::CloseSessionResponse* response) override;
  grpc::ServerUnaryReactor* ForkSession(grpc::CallbackServerContext* context,
                                        const v1::ForkSessionRequest* request,
                                        v1::SessionInfo* response) override;
  grpc::ServerUnaryReactor* PinSession(grpc::CallbackServerContext* context,
                                       const v1::PinSessionRequest* request,
                                       v1::SessionInfo* response) override;
  grpc::ServerUnaryReactor* ListSessions(grpc::CallbackServerContext* context,
                                         const v1::ListSessionsRequest* request,
                                         v1::ListSessionsResponse* response) override;

  // Admin operations (the KvCacheAdmin service forwards here). The *Async forms
  // call `done` exactly once: inline for an error found before any worker call,
  // else on a gRPC thread when the worker answers. None blocks.
  template <typename T>
  using Done = absl::AnyInvocable<void(absl::StatusOr<T>) &&>;
  absl::StatusOr<v1::ListWorkersResponse> ListWorkers() const;
  // Moves session `key` to worker `target` (address or id; empty: wherever
  // placement puts a new session), from `source` (empty: the worker the
  // directory shows it on).
  void MigrateAsync(const SessionKey& key, const std::string& target, const char* reason,
                    Done<v1::MigrateSessionResponse> done, const WorkerId& source = "");
  // The admin API names a session by id alone (AdminMigrateRequest carries no
  // tenant): moves whichever tenant's session has that id, and refuses with
  // FAILED_PRECONDITION when several tenants use it.
  void MigrateByIdAsync(const std::string& session_id, const std::string& target,
                        Done<v1::MigrateSessionResponse> done);
  void DrainWorkerAsync(const std::string& worker, int32_t deadline_ms, Done<v1::DrainResponse> done);
  // MigrateAsync, waiting for the answer: for the router's own threads
  // (evacuation, rebalancing), never for a gRPC callback.
  absl::StatusOr<v1::MigrateSessionResponse> Migrate(const SessionKey& key, const std::string& target,
                                                     const char* reason, const WorkerId& source = "");
  // Where a move of session `key` starts: `source` when not empty (the directory
  // may trail its events), else the directory's worker.
  std::optional<SessionLocation> LocateForMove(const SessionKey& key, const WorkerId& source) const;
  // Migrate to a worker the router picks (MoveTarget), trying the next when one
  // refuses the session, up to kMaxMoveTargets. Blocks.
  absl::StatusOr<v1::MigrateSessionResponse> MigrateToPicked(const SessionKey& key, const char* reason,
                                                             const WorkerId& source = "");
  // MigrateToPicked's moves of the session at `loc`, to workers of MoveTarget(loc,
  // grow_tokens, need_room), up to kMaxMoveTargets; `to` gets the one that took
  // it. NOT_FOUND when the session left loc.worker meanwhile.
  absl::StatusOr<v1::MigrateSessionResponse> MoveToPicked(const SessionLocation& loc, const char* reason,
                                                          int64_t grow_tokens, bool need_room, WorkerId* to);

  const Authenticator& auth() const { return *auth_; }

 private:
  class ProxyReactor;
  template <typename Req, typename Resp>
  class SessionForward;

  // Every call the service answers asynchronously is counted from its start to
  // its last use of the service, so that Shutdown can wait for it. BeginCall is
  // false once Shutdown began (the caller answers UNAVAILABLE).
  bool BeginCall();
  void EndCall();

  // Every worker that may hold `key` now, freshest first: where this router's
  // last request on it left it (for DispatchLedger::kFinishedGrace: a session
  // a turn just moved is still listed on its old worker until both workers'
  // events arrive), then the directory's. A FULL_CONTEXT turn placed elsewhere
  // closes the copies on these; a fork's new id must have none.
  std::vector<WorkerId> SessionHomes(const SessionKey& key) const;
  // An APPEND on `key` must wait (on the executor) before placement: the
  // directory has not heard of the session yet, or its worker drains.
  bool MustWaitForSession(const SessionKey& key) const;
  // The worker for a request, or why there is none. `exclude` holds workers
  // already tried. `wait`: how long an APPEND's session may take to appear in
  // the directory; anything but zero blocks, so only the executor passes it.
  // `chain` (optional) gets the prompt's page hashes when placement computed
  // them (affinity mode, FULL_CONTEXT), else is cleared: the ledger entry.
  // `reply_tokens`: what the request may add to `tokens` (its max_tokens; 0
  // when unknown), so that a worker whose tier 0 cannot hold both comes last.
  absl::StatusOr<Placement> Place(const std::string& session_id, const std::string& tenant, bool append,
                                  const std::vector<int32_t>& tokens, int64_t reply_tokens,
                                  const std::vector<WorkerId>& exclude,
                                  absl::Duration wait = absl::ZeroDuration(),
                                  std::vector<BlockHash>* chain = nullptr);
  // Closes the copy of session `key` that `worker` still holds after a
  // FULL_CONTEXT request on it was served by another worker (round-robin or
  // random placement, or a retry): a session lives on one worker. A close that
  // fails marks the copy stale in the directory (Directory::MarkStale), which
  // keeps it from being taken for the session and lists it again when the
  // worker does; CloseListedStaleCopies then closes it.
  void CloseStaleCopy(const SessionKey& key, const WorkerId& worker);
  // Closes the stale copies that workers listed again (Directory::TakeStaleCopies).
  void CloseListedStaleCopies();
  void Rebalance();
  // Moves the sessions of workers that report `draining` (SIGTERM) elsewhere.
  void EvacuateDraining();
  // Asks the session's worker about it (GetSession) and notes its length in the
  // directory, which knows the lengths of sessions this router served, not of
  // those another router or a direct client grew, so that a move can be sized.
  // Blocks up to 2 s.
  absl::StatusOr<v1::SessionInfo> AskSession(const SessionLocation& s);
  // Whether a request on session `key` runs on `loc.worker` (one this router
  // sent: its ledger; another's: AskSession), or, if `moving_counts`, the
  // session is migrating off it. Blocks up to 2 s.
  bool SessionBusyOn(const SessionKey& key, const SessionLocation& loc, bool moving_counts);
  // Where session `key` is, if that worker drains: where a request of this
  // router's on it runs, else where the directory has it.
  std::optional<SessionLocation> DrainingHome(const SessionKey& key) const;
  // Where a move of the session at `loc` goes when no target is named: workers
  // whose free device pages hold the session, and `grow_tokens` more, twice over
  // come first, then those that hold them once. Past those, any worker placement
  // takes, unless `need_room` (then RESOURCE_EXHAUSTED). Never one of `refused`.
  absl::StatusOr<WorkerId> MoveTarget(const SessionLocation& loc, int64_t grow_tokens, bool need_room,
                                      const std::vector<WorkerId>& refused = {});
  // Moves session `key` off worker `from`, which had no KV memory for a request
  // of `input_tokens` (what an APPEND adds to the session, if `appends`, else
  // the whole context) and `reply_tokens`, to a worker with room for the
  // session and the request, and returns that worker; the directory's worker,
  // without a move, when that is another already. Blocks (the executor's
  // threads only).
  absl::StatusOr<WorkerId> MoveForRoom(const SessionKey& key, const WorkerId& from, int64_t input_tokens,
                                       int64_t reply_tokens, bool appends);

  const RouterOptions options_;
  WorkerPool* const pool_;
  Directory* const directory_;
  DispatchLedger ledger_;
  const tok::Tokenizer* const tokenizer_;
  const tok::ChatTemplate* const chat_template_;
  const Authenticator* const auth_;
  RouterMetrics* const metrics_;
  std::atomic<uint64_t> round_robin_{0};

  Executor executor_;

  // Held by a proxy from its placement until the ledger has it (see Attempt);
  // taken before any other lock.
  absl::Mutex placement_mu_;
  absl::Mutex mu_;
  std::mt19937_64 rng_ ABSL_GUARDED_BY(mu_){12345};
  int64_t calls_in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;
  absl::Notification stop_;
  // Rebalancer thread only: for each worker a session moved off or onto, its
  // load_reports count once the move had finished. Its load stays unused until
  // two more reports came (the first may have been on its way before the move).
  absl::flat_hash_map<WorkerId, int64_t> rebalance_moved_at_report_;
  std::thread rebalancer_;
  std::thread evacuator_;
};

// KvCacheAdmin: authenticates as admin and forwards to the RouterService.
class AdminService final : public v1::KvCacheAdmin::CallbackService {
 public:
  explicit AdminService(RouterService* router) : router_(router) {}
  grpc::ServerUnaryReactor* ListWorkers(grpc::CallbackServerContext* context,
                                        const v1::ListWorkersRequest* request,
                                        v1::ListWorkersResponse* response) override;
  grpc::ServerUnaryReactor* MigrateSession(grpc::CallbackServerContext* context,
                                           const v1::AdminMigrateRequest* request,
                                           v1::MigrateSessionResponse* response) override;
  grpc::ServerUnaryReactor* DrainWorker(grpc::CallbackServerContext* context,
                                        const v1::DrainWorkerRequest* request,
                                        v1::DrainResponse* response) override;

 private:
  RouterService* const router_;
};

}  // namespace kvcache::router

#endif  // KVCACHE_ROUTER_ROUTER_SERVICE_H_
