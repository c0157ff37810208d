#include "common/server.h"

#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/security/credentials.h"

namespace kvcache {
namespace {

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The host of a "host:port" address (ValidateAddress gave it a port).
std::string HostOf(const std::string& address) {
  const auto pos = address.rfind(':');
  return pos == std::string::npos ? address : address.substr(0, pos);
}

// "host:port" with the host kept and the port replaced.
std::string WithPort(const std::string& address, int port) {
  return absl::StrCat(HostOf(address), ":", port);
}

// Destroys `exposer` (listening on `address` with its port `port`) promptly.
// civetweb's listener thread polls its sockets in 2 s quanta and sees mg_stop's
// flag only when a poll returns, so a plain destruction added up to 2 s to
// every shutdown. A connection to the port wakes that poll: one is made every
// 10 ms until the destruction returns (those accepted before the flag is set
// close at once, unread).
void StopExposer(std::unique_ptr<prometheus::Exposer> exposer, const std::string& address, int port) {
  if (exposer == nullptr) return;
  std::string host = HostOf(address);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  if (host.empty() || host == "0.0.0.0") host = "127.0.0.1";
  if (host == "::") host = "::1";
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* peer = nullptr;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &peer) != 0) peer = nullptr;
  absl::Notification stopped;
  std::thread waker([&] {
    if (peer == nullptr) return;
    do {
      // Non-blocking, each attempt bounded: the port is this process's own, but
      // a connect must never hold the shutdown.
      const int fd =
          socket(peer->ai_family, peer->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, peer->ai_protocol);
      if (fd >= 0) {
        if (connect(fd, peer->ai_addr, peer->ai_addrlen) != 0 && errno == EINPROGRESS) {
          pollfd p{fd, POLLOUT, 0};
          (void)poll(&p, 1, 10);
        }
        close(fd);
      }
    } while (!stopped.WaitForNotificationWithTimeout(absl::Milliseconds(10)));
  });
  exposer.reset();
  stopped.Notify();
  waker.join();
  if (peer != nullptr) freeaddrinfo(peer);
}

// Write end of the live ServerProcess's signal pipe (-1 when none): a process
// has one set of signal dispositions, so at most one ServerProcess at a time
// receives signals.
std::atomic<int> g_signal_fd{-1};

void OnSignal(int sig) {
  const int saved = errno;
  const unsigned char b = static_cast<unsigned char>(sig);
  const int fd = g_signal_fd.load();
  if (fd >= 0) (void)!write(fd, &b, 1);
  errno = saved;
}

// gRPC 1.51, without a background poller, runs every callback-API completion
// on one process-wide queue and its threads. The last Channel or Server that
// holds the queue shuts it down, joins its threads and frees it as it lets go
// (a server does at Shutdown). The services delete call objects on those
// threads (a worker call, a session forward), each holding its channel: after
// the server had stopped, a call that held the last reference to its worker's
// channel made its own thread join itself and free the queue under it, an
// abort after "stopped" in about one SIGTERM in 20 with a stream in flight.
// This channel holds the queue for the life of the process: it made one
// callback call (to a Unix socket path that does not exist, so nothing is
// sent) and is never destroyed (reachable from here, so not a leak).
void HoldCallbackQueue() {
  static std::shared_ptr<grpc::Channel>* const holder = [] {
    auto* channel = new std::shared_ptr<grpc::Channel>(
        grpc::CreateChannel("unix:/nonexistent/kvcache-callback-queue", grpc::InsecureChannelCredentials()));
    struct Call {
      grpc::ClientContext ctx;
      grpc::ByteBuffer request;
      grpc::ByteBuffer response;
    };
    auto* call = new Call;
    grpc::Slice empty;
    call->request = grpc::ByteBuffer(&empty, 1);  // a message of no bytes
    call->ctx.set_deadline(std::chrono::system_clock::now());
    grpc::GenericStub(*channel).UnaryCall(&call->ctx, "/kvcache.v1.None/None", grpc::StubOptions(),
                                          &call->request, &call->response,
                                          [call](const grpc::Status&) { delete call; });
    return channel;
  }();
  (void)holder;
}

}  // namespace

// What the exposer collects: the registry, after the scrape hook ran.
class ServerProcess::ScrapeCollectable : public prometheus::Collectable {
 public:
  explicit ScrapeCollectable(std::shared_ptr<prometheus::Registry> registry)
      : registry_(std::move(registry)) {}

  std::vector<prometheus::MetricFamily> Collect() const override {
    {
      // Under the lock so that SetHook(nullptr) waits for a running hook: after
      // it returns, nothing the old hook referenced is touched again.
      absl::MutexLock lock(&mu_);
      if (hook_) hook_();
    }
    return registry_->Collect();
  }

  void SetHook(std::function<void()> hook) {
    absl::MutexLock lock(&mu_);
    hook_ = std::move(hook);
  }

 private:
  const std::shared_ptr<prometheus::Registry> registry_;
  mutable absl::Mutex mu_;
  std::function<void()> hook_ ABSL_GUARDED_BY(mu_);
};

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(const ServerOptions& options) {
  if (options.tls_cert_file.empty() && options.tls_key_file.empty()) {
    if (!options.tls_client_ca_file.empty()) {
      return absl::InvalidArgumentError("--tls_client_ca needs --tls_cert and --tls_key");
    }
    return grpc::InsecureServerCredentials();
  }
  if (options.tls_cert_file.empty() || options.tls_key_file.empty()) {
    return absl::InvalidArgumentError("TLS needs both --tls_cert and --tls_key");
  }
  grpc::SslServerCredentialsOptions ssl(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  KVCACHE_ASSIGN_OR_RETURN(pair.cert_chain, ReadFile(options.tls_cert_file));
  KVCACHE_ASSIGN_OR_RETURN(pair.private_key, ReadFile(options.tls_key_file));
  ssl.pem_key_cert_pairs.push_back(pair);
  if (!options.tls_client_ca_file.empty()) {
    KVCACHE_ASSIGN_OR_RETURN(ssl.pem_root_certs, ReadFile(options.tls_client_ca_file));
    ssl.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(ssl);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakePeerCredentials(const ServerOptions& options) {
  grpc::SslCredentialsOptions ssl;
  if (!options.tls_client_ca_file.empty()) {
    KVCACHE_ASSIGN_OR_RETURN(ssl.pem_root_certs, ReadFile(options.tls_client_ca_file));
  }
  KVCACHE_ASSIGN_OR_RETURN(ssl.pem_cert_chain, ReadFile(options.tls_cert_file));
  KVCACHE_ASSIGN_OR_RETURN(ssl.pem_private_key, ReadFile(options.tls_key_file));
  return grpc::SslCredentials(ssl);
}

ServerProcess::ServerProcess(const ServerOptions& options)
    : options_(options), registry_(std::make_shared<prometheus::Registry>()) {}

absl::StatusOr<std::unique_ptr<ServerProcess>> ServerProcess::Init(const ServerOptions& options) {
  if (options.name.empty()) return absl::InvalidArgumentError("ServerOptions.name is empty");
  if (options.shutdown_deadline < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("shutdown deadline must not be negative");
  }
  // SIGTERM/SIGINT may land on any thread, including ones that libraries start
  // before main (OpenBLAS's pool), so blocking them per thread is not enough: a
  // handler writes the signal number into a pipe that the signal thread reads.
  HoldCallbackQueue();
  std::unique_ptr<ServerProcess> p(new ServerProcess(options));
  if (pipe2(p->signal_pipe_, O_CLOEXEC) != 0)
    return absl::InternalError(absl::StrCat("pipe: ", strerror(errno)));
  g_signal_fd = p->signal_pipe_[1];
  struct sigaction sa {};
  sa.sa_handler = OnSignal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
  if (!options.metrics_address.empty()) {
    try {
      p->exposer_ = std::make_unique<prometheus::Exposer>(options.metrics_address, 2);
    } catch (const std::exception& e) {
      return absl::UnavailableError(
          absl::StrCat("cannot serve /metrics on ", options.metrics_address, ": ", e.what()));
    }
    p->scrape_ = std::make_shared<ScrapeCollectable>(p->registry_);
    p->exposer_->RegisterCollectable(p->scrape_);
    auto ports = p->exposer_->GetListeningPorts();
    if (ports.empty()) return absl::InternalError("/metrics exposer reports no port");
    p->metrics_port_ = ports.front();
  }
  p->signal_thread_ = std::thread([raw = p.get()] { raw->WaitForSignals(); });
  return p;
}

ServerProcess::~ServerProcess() {
  RequestShutdown();
  if (signal_thread_.joinable()) signal_thread_.join();
  int expected = signal_pipe_[1];
  g_signal_fd.compare_exchange_strong(expected, -1);
  for (int fd : signal_pipe_) {
    if (fd >= 0) close(fd);
  }
  StopExposer(std::move(exposer_), options_.metrics_address, metrics_port_);
}

void ServerProcess::WaitForSignals() {
  while (true) {
    unsigned char sig = 0;
    const ssize_t n = read(signal_pipe_[0], &sig, 1);
    if (n < 0 && errno == EINTR) continue;
    if (n != 1 || sig == 0) return;  // 0: RequestShutdown's wake-up
    if (!shutdown_requested_.HasBeenNotified()) {
      KV_LOG_INFO("{} received {}; shutting down", options_.name, sig == SIGTERM ? "SIGTERM" : "SIGINT");
      shutdown_requested_.Notify();
    }
    return;
  }
}

void ServerProcess::SetCollectHook(std::function<void()> hook) {
  if (scrape_ != nullptr) scrape_->SetHook(std::move(hook));
}

void ServerProcess::RequestShutdown() {
  if (shutdown_requested_.HasBeenNotified()) return;
  shutdown_requested_.Notify();
  const unsigned char wake = 0;
  (void)!write(signal_pipe_[1], &wake, 1);  // ends the signal thread's read
}

void ServerProcess::SetReady(bool ready) {
  absl::MutexLock lock(&mu_);
  ready_ = ready;
  if (server_ != nullptr) health_.SetServingStatus(kReadinessService, ready);
}

absl::Status ServerProcess::Serve(const std::vector<grpc::Service*>& services,
                                  std::function<void(absl::Time deadline)> on_shutdown) {
  if (services.empty()) return absl::InvalidArgumentError("Serve needs at least one service");
  KVCACHE_ASSIGN_OR_RETURN(auto creds, MakeServerCredentials(options_));
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(options_.grpc_address, creds, &port);
  builder.SetMaxReceiveMessageSize(options_.max_receive_message_bytes);
  options_.keepalive.ApplyTo(&builder);
  if (options_.max_connection_age > absl::ZeroDuration()) {
    builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_MS, MillisArg(options_.max_connection_age));
    builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_GRACE_MS,
                               MillisArg(options_.max_connection_age_grace));
  }
  builder.RegisterService(&health_);
  for (grpc::Service* s : services) builder.RegisterService(s);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", options_.grpc_address));
  }
  grpc_port_ = port;
  health_.SetServingStatus("", true);
  health_.SetServingStatus(kLivenessService, true);
  {
    absl::MutexLock lock(&mu_);
    server_ = server.get();
    health_.SetServingStatus(kReadinessService, ready_);
  }
  std::string fields;
  for (size_t i = 0; i < frontends_.size(); ++i) {
    absl::StatusOr<std::string> field =
        frontends_[i]->Start(server->InProcessChannel(grpc::ChannelArguments()));
    if (!field.ok()) {
      for (size_t j = 0; j < i; ++j) frontends_[j]->Stop();
      health_.Shutdown();
      server->Shutdown();
      server->Wait();
      absl::MutexLock lock(&mu_);
      server_ = nullptr;
      return field.status();
    }
    absl::StrAppend(&fields, " ", *field);
  }
  std::printf("%s listening grpc=%s metrics=%s%s\n", options_.name.c_str(),
              WithPort(options_.grpc_address, port).c_str(),
              metrics_port_ == 0 ? "off" : WithPort(options_.metrics_address, metrics_port_).c_str(),
              fields.c_str());
  std::fflush(stdout);
  KV_LOG_INFO("{} serving gRPC on port {}, /metrics on port {}", options_.name, port, metrics_port_);

  shutdown_requested_.WaitForNotification();

  const absl::Time deadline = absl::Now() + options_.shutdown_deadline;
  if (on_shutdown) on_shutdown(deadline);
  // Every health status NOT_SERVING, and Watch streams end (they would hold
  // the server's shutdown until the deadline).
  health_.Shutdown();
  for (Frontend* f : frontends_) f->Drain(deadline);
  server->Shutdown(absl::ToChronoTime(std::min(deadline, absl::Now() + options_.stop_grace)));
  server->Wait();
  for (Frontend* f : frontends_) f->Stop();
  {
    absl::MutexLock lock(&mu_);
    server_ = nullptr;
  }
  KV_LOG_INFO("{} stopped", options_.name);
  return absl::OkStatus();
}

}  // namespace kvcache
