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
// duplicated tokens. An APPEND request whose worker is lost fails with
// UNAVAILABLE naming the session.
//
// Thread-safety: handlers run on gRPC threads; each Generate proxies on its own
// thread (joined at shutdown). Shared state is in the thread-safe directory,
// pool and metrics.
#ifndef KVCACHE_ROUTER_ROUTER_SERVICE_H_
#define KVCACHE_ROUTER_ROUTER_SERVICE_H_

#include <atomic>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/tokenizer/chat_template.h"
#include "common/tokenizer/tokenizer.h"
#include "kvcache/v1/router.grpc.pb.h"
#include "router/auth.h"
#include "router/directory.h"
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
  // How often the router looks for draining workers to evacuate.
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
};

class RouterService final : public v1::KvCache::CallbackService {
 public:
  // All pointers must outlive the service. `chat_template` may be null.
  RouterService(RouterOptions options, WorkerPool* pool, Directory* directory,
                const tok::Tokenizer* tokenizer, const tok::ChatTemplate* chat_template,
                const Authenticator* auth, RouterMetrics* metrics);
  ~RouterService() override;  // Shutdown()

  // Ends the rebalancer and waits for proxy threads.
  void Shutdown();

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

  // Admin operations (the KvCacheAdmin service forwards here).
  absl::StatusOr<v1::ListWorkersResponse> ListWorkers() const;
  absl::StatusOr<v1::MigrateSessionResponse> Migrate(const std::string& session_id, const std::string& target,
                                                     const char* reason);
  absl::StatusOr<v1::DrainResponse> DrainWorker(const std::string& worker, int32_t deadline_ms);

  const Authenticator& auth() const { return *auth_; }
  // Runs `fn` on a thread that Shutdown joins (calls that block on workers).
  void RunInBackground(std::function<void()> fn);

 private:
  class ProxyReactor;

  // The worker for a request, or why there is none. `exclude` holds workers
  // already tried.
  absl::StatusOr<Placement> Place(const std::string& session_id, const std::string& tenant, bool append,
                                  const std::vector<int32_t>& tokens, const std::vector<WorkerId>& exclude);
  void Rebalance();
  // Moves the sessions of workers that report `draining` (SIGTERM) elsewhere.
  void EvacuateDraining();

  const RouterOptions options_;
  WorkerPool* const pool_;
  Directory* const directory_;
  const tok::Tokenizer* const tokenizer_;
  const tok::ChatTemplate* const chat_template_;
  const Authenticator* const auth_;
  RouterMetrics* const metrics_;
  std::atomic<uint64_t> round_robin_{0};

  absl::Mutex mu_;
  std::mt19937_64 rng_ ABSL_GUARDED_BY(mu_){12345};
  std::vector<std::thread> threads_ ABSL_GUARDED_BY(mu_);
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;
  absl::Notification stop_;
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
