// Process bootstrap shared by every kvcache server binary.
//
// Order matters (see Init): the Prometheus exposer starts before anything loads a
// GPU library. prometheus-cpp serves /metrics through civetweb, whose threads
// cannot start once libcublasLt (94 KB of static TLS) is in the process; threads
// already running keep serving. So a binary calls ServerProcess::Init first, then
// loads backends (the CUDA backend is a plugin opened with dlopen), then Serve.
//
//   auto process = ServerProcess::Init(options);     // signals + /metrics
//   ... load the model, maybe dlopen the CUDA backend ...
//   return process->Serve({&service});               // blocks until SIGTERM/SIGINT
//
// Health (grpc.health.v1): service "" and "liveness" report SERVING while the
// process runs; "readiness" reports SERVING once Serve starts and the binary has
// not called SetReady(false) (e.g. while draining). Reflection (v1alpha) lists
// every registered service. Shutdown turns every status NOT_SERVING and ends
// Watch streams (common/health_service.h).
//
// Thread-safety: SetReady and RequestShutdown may be called from any thread.
#ifndef KVCACHE_COMMON_SERVER_H_
#define KVCACHE_COMMON_SERVER_H_

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/health_service.h"
#include "common/keepalive.h"
#include "grpcpp/grpcpp.h"
#include "prometheus/exposer.h"
#include "prometheus/registry.h"

namespace kvcache {

// Health service names a prober asks for.
inline constexpr char kLivenessService[] = "liveness";
inline constexpr char kReadinessService[] = "readiness";

struct ServerOptions {
  // Process name for logs and the "listening" line (e.g. "kvcache-worker").
  std::string name;
  // gRPC listen address; port 0 picks a free port.
  std::string grpc_address = "127.0.0.1:0";
  // /metrics listen address; port 0 picks a free port; empty disables.
  std::string metrics_address = "127.0.0.1:0";
  // How long running RPCs may take to finish after SIGTERM before being cancelled.
  absl::Duration shutdown_deadline = absl::Seconds(10);
  // Once Serve's `on_shutdown` has returned, how long the calls still running
  // may hold the server's stop, within shutdown_deadline. gRPC closes a
  // client's idle connection only when its client reads the GOAWAY, or at this
  // point: a process whose on_shutdown has finished its work (a worker whose
  // sessions have left) would otherwise wait out the deadline for clients that
  // hold idle channels without polling them.
  absl::Duration stop_grace = absl::InfiniteDuration();
  // Largest gRPC message received, in bytes.
  int max_receive_message_bytes = 8 << 20;
  // Pings of the connections it accepts (and, in the binaries, of the channels
  // they open to peers).
  Keepalive keepalive;
  // After this long a connection is asked to close (GOAWAY), and its client
  // reconnects, through a Service's load balancing to any replica: without it
  // a gRPC client keeps one connection, to one router pod, for as long as both
  // live, and routers added by a scale-out get none of its calls. Calls in
  // flight then get max_connection_age_grace to finish. Zero: never.
  absl::Duration max_connection_age = absl::ZeroDuration();
  absl::Duration max_connection_age_grace = absl::Minutes(10);
  // Optional TLS: PEM paths. With cert and key set the server speaks TLS; with a
  // client CA too it requires client certificates (mutual TLS).
  std::string tls_cert_file;
  std::string tls_key_file;
  std::string tls_client_ca_file;
  // Peer authentication (common/peer_auth.h): the fleet's shared token file, and
  // the explicit opt-out of authentication.
  std::string cluster_token_file;
  bool allow_unauthenticated = false;
};

class ServerProcess {
 public:
  // Installs SIGTERM/SIGINT handlers (a dedicated thread turns them into a
  // shutdown) and starts the /metrics exposer. One ServerProcess per process.
  static absl::StatusOr<std::unique_ptr<ServerProcess>> Init(const ServerOptions& options);

  ~ServerProcess();
  ServerProcess(const ServerProcess&) = delete;
  ServerProcess& operator=(const ServerProcess&) = delete;

  // The registry served on /metrics. Register collectors before or after Serve.
  prometheus::Registry& metrics() { return *registry_; }
  std::shared_ptr<prometheus::Registry> metrics_ptr() { return registry_; }

  // Runs `hook` at the start of every /metrics scrape, so gauges that mirror
  // other state are fresh when read. Replaces any earlier hook.
  void SetCollectHook(std::function<void()> hook);

  // Port the /metrics endpoint listens on (0 when disabled).
  int metrics_port() const { return metrics_port_; }

  // Builds and starts the gRPC server with `services` (not owned; they must
  // outlive this object), starts the frontends, prints "<name> listening
  // grpc=HOST:PORT metrics=HOST:PORT" (and each frontend's field) on stdout,
  // marks readiness SERVING, then blocks until a
  // signal or RequestShutdown. Then `on_shutdown` (optional) runs, before the
  // server stops accepting, with the shutdown's deadline (`shutdown_deadline`
  // from the signal); readiness and liveness turn NOT_SERVING; RPCs still
  // running get what is left until that deadline (then they are cancelled), and
  // Serve returns. One deadline covers the whole shutdown.
  absl::Status Serve(const std::vector<grpc::Service*>& services,
                     std::function<void(absl::Time deadline)> on_shutdown = nullptr);

  // Readiness (not liveness). Safe before Serve (applied when it starts).
  void SetReady(bool ready);

  // A front door in another protocol that serves by calling this process's own
  // gRPC services (the router's OpenAI-compatible HTTP API): one
  // implementation of authentication, validation and status codes.
  class Frontend {
   public:
    virtual ~Frontend() = default;
    // Called by Serve once the gRPC server runs; `channel` reaches its services
    // in-process (no socket, no TLS). Returns the field the listening line
    // shows, e.g. "http=127.0.0.1:8080".
    virtual absl::StatusOr<std::string> Start(std::shared_ptr<grpc::Channel> channel) = 0;
    // Called by Serve when shutdown begins, before the gRPC server stops (whose
    // in-process calls end when it does): answer new requests "shutting down"
    // and let running ones go on until they end or `deadline` passes.
    virtual void Drain(absl::Time deadline) = 0;
    // Called by Serve after the gRPC server has shut down (every call ended),
    // before the server is destroyed.
    virtual void Stop() = 0;
  };
  // REQUIRES: before Serve. `frontend` is not owned and must outlive Serve.
  void AddFrontend(Frontend* frontend) { frontends_.push_back(frontend); }

  // Ends Serve as if SIGTERM arrived.
  void RequestShutdown();

  // gRPC port chosen by Serve (0 before it starts).
  int grpc_port() const { return grpc_port_.load(); }

 private:
  explicit ServerProcess(const ServerOptions& options);
  void WaitForSignals();

  const ServerOptions options_;
  class ScrapeCollectable;
  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<ScrapeCollectable> scrape_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  int metrics_port_ = 0;
  std::atomic<int> grpc_port_{0};
  std::vector<Frontend*> frontends_;
  HealthService health_;  // outlives the server Serve builds

  absl::Notification shutdown_requested_;
  int signal_pipe_[2] = {-1, -1};  // the signal handler writes, signal_thread_ reads
  std::thread signal_thread_;

  absl::Mutex mu_;
  grpc::Server* server_ ABSL_GUARDED_BY(mu_) = nullptr;
  bool ready_ ABSL_GUARDED_BY(mu_) = true;
};

// Builds server credentials from the TLS fields of `options` (insecure when none).
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(const ServerOptions& options);

// Client credentials for calls to peers of the same fleet (worker to worker):
// trusts tls_client_ca (the CA that signs the fleet) and presents tls_cert and
// tls_key. REQUIRES: tls_cert_file set.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakePeerCredentials(const ServerOptions& options);

}  // namespace kvcache

#endif  // KVCACHE_COMMON_SERVER_H_
