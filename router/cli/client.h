// A synchronous client for kvcache-cli: one channel to a router (kvcache.v1.KvCache
// and KvCacheAdmin) or straight to a worker (kvcache.v1.Worker, which serves the
// same Generate and session messages), with bearer-token metadata, optional TLS
// and a deadline on every call.
//
// Thread-safety: a Client may be used from one thread at a time.
#ifndef KVCACHE_ROUTER_CLI_CLIENT_H_
#define KVCACHE_ROUTER_CLI_CLIENT_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "kvcache/v1/router.grpc.pb.h"
#include "kvcache/v1/worker.grpc.pb.h"

namespace kvcache::cli {

// Which service the address serves.
enum class Target { kRouter, kWorker };

// "router" or "worker".
const char* TargetName(Target target);
// INVALID_ARGUMENT unless `name` is "router" or "worker".
absl::StatusOr<Target> ParseTarget(const std::string& name);

struct ClientOptions {
  std::string address = "127.0.0.1:7000";  // host:port
  Target target = Target::kRouter;
  std::string token;          // sent as `authorization: Bearer <token>` when set
  std::string tls_ca_file;    // PEM roots; TLS is used when set
  std::string tls_cert_file;  // client certificate (mutual TLS), with tls_key_file
  std::string tls_key_file;
  std::string tls_server_name;                        // overrides the name checked against the certificate
  absl::Duration timeout = absl::Seconds(60);         // deadline of each call
  absl::Duration connect_timeout = absl::Seconds(5);  // how long Connect waits
};

class Client;
using ClientPtr = std::unique_ptr<Client>;

class Client {
 public:
  // Opens the channel and waits until it is connected. UNAVAILABLE naming the
  // address when it does not connect within connect_timeout; INVALID_ARGUMENT
  // when a TLS file cannot be read or mutual-TLS files come alone.
  static absl::StatusOr<ClientPtr> Connect(const ClientOptions& options);

  const ClientOptions& options() const { return options_; }

  // Runs one Generate call, handing each streamed token to `on_token` as it
  // arrives. Returns the Final message, or the call's status (tokens that arrived
  // before a failure were already handed over; `tokens_seen` counts them).
  absl::StatusOr<v1::GenerateResponse::Final> Generate(
      const v1::GenerateRequest& request,
      const std::function<void(const v1::GenerateResponse::Token&)>& on_token, int* tokens_seen = nullptr);
  // Cancels the Generate call running now, if any; it then returns CANCELLED
  // (a chat's "stop generating", from another thread). Returns whether one ran.
  bool CancelGenerate();

  absl::StatusOr<v1::SessionInfo> GetSession(const std::string& session_id);
  absl::StatusOr<v1::ListSessionsResponse> ListSessions();
  absl::StatusOr<v1::CloseSessionResponse> CloseSession(const std::string& session_id);

  // Router only (FAILED_PRECONDITION against a worker).
  absl::StatusOr<v1::ListWorkersResponse> ListWorkers();
  // Router: `to` is a worker id or address (empty lets the router choose).
  // Worker: the session moves from this worker to the worker at address `to`.
  absl::StatusOr<v1::MigrateSessionResponse> MigrateSession(const std::string& session_id,
                                                            const std::string& to);
  // Router: drains the named worker. Worker: drains this worker (`worker` must be
  // empty or its address), offloading idle sessions. deadline_ms 0 = server default.
  absl::StatusOr<v1::DrainResponse> Drain(const std::string& worker, int32_t deadline_ms);

 private:
  Client(ClientOptions options, std::shared_ptr<grpc::Channel> channel);
  // Deadline and authorization metadata for one call.
  void Prepare(grpc::ClientContext* ctx) const;

  ClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::KvCache::Stub> router_;
  std::unique_ptr<v1::KvCacheAdmin::Stub> admin_;
  std::unique_ptr<v1::Worker::Stub> worker_;
  absl::Mutex mu_;
  grpc::ClientContext* generating_ ABSL_GUARDED_BY(mu_) = nullptr;  // the running Generate call's
};

}  // namespace kvcache::cli

#endif  // KVCACHE_ROUTER_CLI_CLIENT_H_
