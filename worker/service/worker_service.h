// The kvcache.v1.Worker gRPC service: Generate streams, session calls, Watch,
// export/import/migrate, drain. Everything is validated here (the edge) and
// mapped to gRPC status codes once, through common/status.h.
//
// Concurrency: requests on one session are never interleaved; a second request
// is refused with ABORTED (the engine's rule), so a router can retry elsewhere
// or report it rather than queue invisibly.
//
// Thread-safety: gRPC calls the handlers from its threads; all state is in the
// thread-safe engine, KV cache and hub, plus the atomics and mutex below.
#ifndef KVCACHE_WORKER_SERVICE_WORKER_SERVICE_H_
#define KVCACHE_WORKER_SERVICE_WORKER_SERVICE_H_

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/peer_auth.h"
#include "common/tokenizer/chat_template.h"
#include "common/tokenizer/tokenizer.h"
#include "grpcpp/security/credentials.h"
#include "kvcache/v1/worker.grpc.pb.h"
#include "worker/kv/kv_cache_manager.h"
#include "worker/sched/engine.h"
#include "worker/service/watch_hub.h"
#include "worker/service/worker_metrics.h"

namespace kvcache::service {

struct WorkerServiceOptions {
  std::string worker_id;
  std::string model_id;
  // How long Drain waits for running streams before migrating what is left.
  absl::Duration drain_deadline = absl::Seconds(30);
  // Largest chunk payload of exports and migrations.
  int64_t max_chunk_bytes = 2 << 20;
  // Credentials for worker-to-worker calls (migration); insecure when null.
  std::shared_ptr<grpc::ChannelCredentials> peer_credentials;
  grpc::ChannelArguments peer_channel_args;  // of those calls' channels (keepalive)
  // The fleet's shared token: required of every caller, sent to migration
  // targets, which must prove they hold it too. Empty: callers are
  // authenticated by mutual TLS, or not at all (--allow_unauthenticated).
  ClusterToken cluster_token;
};

class WorkerService : public v1::Worker::CallbackService {
 public:
  // `set_ready` flips readiness; `request_exit` ends the process after a drain.
  // All pointers must outlive the service.
  WorkerService(WorkerServiceOptions options, sched::Engine* engine, kv::KvCacheManager* kv,
                const tok::Tokenizer* tokenizer, const tok::ChatTemplate* chat_template, WatchHub* hub,
                WorkerMetrics* metrics, std::function<void(bool)> set_ready,
                std::function<void()> request_exit);
  ~WorkerService() override;  // waits for background migrations

  bool draining() const { return draining_.load(); }
  // UNAVAILABLE (kWorkerDrainingMessage) while draining, else OK: the answer of
  // every call that would create, change or move in a session (Generate,
  // ForkSession, PinSession, OffloadSession, RestoreSession, ImportSession) once
  // the drain began. The calls the drain itself needs (MigrateSession,
  // ExportSession), reads, CloseSession and Watch are still served.
  absl::Status RefuseWhileDraining() const;
  // Stops taking new work: readiness NOT_SERVING, Generate answers UNAVAILABLE.
  void BeginDrain();
  // Lets running requests finish for `streams_for`, then cuts the rest
  // (UNAVAILABLE kStreamCutByDrainMessage: their clients and sessions keep what
  // was sent, so the sessions can move) and waits up to `cut_wait` for them to
  // end (the next step boundary).
  void FinishOrCutStreams(absl::Duration streams_for, absl::Duration cut_wait);
  // Waits up to `timeout` for the imports in flight to end (a draining worker
  // refuses their commits, see ImportReactor, or took them before it drained:
  // then they are sessions, which the drain moves on). True when none is left.
  // Before, a worker SIGTERMed during an import counted no session, exited, and
  // the import committed into the exiting process: the session was lost (qa27).
  bool WaitNoImports(absl::Duration timeout);
  // Drains: waits for running requests (bounded by `deadline`, then cut), then
  // migrates idle sessions to `targets` in turn (offloads them when there are
  // none).
  v1::DrainResponse DrainAndMigrate(const std::vector<std::string>& targets, absl::Duration deadline);

  // Moves a session to the worker at `target`: pre-copies its pages while it keeps
  // serving, then pauses it for the tail and commits on the target; on success the
  // session is dropped here. On any failure it stays here, whole.
  absl::StatusOr<v1::MigrateSessionResponse> Migrate(const std::string& session_id, const std::string& tenant,
                                                     const std::string& target);

  // --- gRPC handlers ----------------------------------------------------------
  grpc::ServerWriteReactor<v1::GenerateResponse>* Generate(grpc::CallbackServerContext* context,
                                                           const v1::GenerateRequest* request) override;
  grpc::ServerUnaryReactor* GetSession(grpc::CallbackServerContext* context,
                                       const v1::SessionRequest* request, v1::SessionInfo* response) override;
  grpc::ServerUnaryReactor* ListSessions(grpc::CallbackServerContext* context,
                                         const v1::ListSessionsRequest* request,
                                         v1::ListSessionsResponse* response) override;
  grpc::ServerUnaryReactor* CloseSession(grpc::CallbackServerContext* context,
                                         const v1::SessionRequest* request,
                                         v1::CloseSessionResponse* response) override;
  grpc::ServerUnaryReactor* ForkSession(grpc::CallbackServerContext* context,
                                        const v1::ForkSessionRequest* request,
                                        v1::SessionInfo* response) override;
  grpc::ServerUnaryReactor* PinSession(grpc::CallbackServerContext* context,
                                       const v1::PinSessionRequest* request,
                                       v1::SessionInfo* response) override;
  grpc::ServerUnaryReactor* OffloadSession(grpc::CallbackServerContext* context,
                                           const v1::SessionRequest* request,
                                           v1::SessionInfo* response) override;
  grpc::ServerUnaryReactor* RestoreSession(grpc::CallbackServerContext* context,
                                           const v1::SessionRequest* request,
                                           v1::SessionInfo* response) override;
  grpc::ServerWriteReactor<v1::WatchEvent>* Watch(grpc::CallbackServerContext* context,
                                                  const v1::WatchRequest* request) override;
  grpc::ServerWriteReactor<v1::SessionChunk>* ExportSession(grpc::CallbackServerContext* context,
                                                            const v1::ExportSessionRequest* request) override;
  grpc::ServerReadReactor<v1::SessionChunk>* ImportSession(grpc::CallbackServerContext* context,
                                                           v1::SessionInfo* response) override;
  grpc::ServerUnaryReactor* MigrateSession(grpc::CallbackServerContext* context,
                                           const v1::MigrateSessionRequest* request,
                                           v1::MigrateSessionResponse* response) override;
  grpc::ServerUnaryReactor* Drain(grpc::CallbackServerContext* context, const v1::DrainRequest* request,
                                  v1::DrainResponse* response) override;
  grpc::ServerUnaryReactor* PeerHandshake(grpc::CallbackServerContext* context,
                                          const v1::PeerHandshakeRequest* request,
                                          v1::PeerHandshakeResponse* response) override;

  // Background threads (migrations, drains) not yet joined: those running, and
  // finished ones until the next RunInBackground joins them.
  size_t background_threads() const;

  // The session as the wire describes it. NOT_FOUND for unknown or other tenants'.
  absl::StatusOr<v1::SessionInfo> Describe(const std::string& id, const std::string& tenant) const;

 private:
  class GenerateReactor;
  class ExportReactor;
  class ImportReactor;

  // OK when the caller is a peer of the fleet (see common/peer_auth.h).
  absl::Status Authorize(const grpc::CallbackServerContext& context) const;
  // Asks `stub`'s worker to prove it holds our cluster token (no-op without one).
  absl::Status CheckTarget(v1::Worker::Stub* stub, const std::string& target) const;

  // Runs `fn` on a background thread that the destructor joins.
  void RunInBackground(std::function<void()> fn);

  const WorkerServiceOptions options_;
  sched::Engine* const engine_;
  kv::KvCacheManager* const kv_;
  const tok::Tokenizer* const tokenizer_;
  const tok::ChatTemplate* const chat_template_;
  WatchHub* const hub_;
  WorkerMetrics* const metrics_;
  const std::function<void(bool)> set_ready_;
  const std::function<void()> request_exit_;
  std::atomic<bool> draining_{false};

  struct Background {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;  // set as its last act
  };
  mutable absl::Mutex mu_;
  std::vector<Background> background_ ABSL_GUARDED_BY(mu_);
  int imports_in_flight_ ABSL_GUARDED_BY(mu_) = 0;  // ImportReactors between Start and Done
};

}  // namespace kvcache::service

#endif  // KVCACHE_WORKER_SERVICE_WORKER_SERVICE_H_
