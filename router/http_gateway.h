// The router's OpenAI-compatible HTTP front door (--http_listen).
//
// A translator: each HTTP request becomes a call to the router's own public
// gRPC services over an in-process channel, with the Authorization header
// forwarded as gRPC metadata, so authentication, tenants, quotas, validation
// and status codes have one implementation (router_service.h). Routes:
//   POST /v1/chat/completions, POST /v1/completions  KvCache.Generate (FULL_CONTEXT)
//   GET  /v1/models, /v1/models/{id}                 the served model names
//   GET  /health, /ready                             grpc.health.v1 "liveness", "readiness"
// Bodies and errors: router/openai_api.h. Streams are Server-Sent Events
// ("data: {chunk}" events, "data: [DONE]" last) written as each token arrives;
// the status line waits for the first token, so that an error before it has
// its own HTTP status. A client that goes away (its socket closes) cancels
// the gRPC call, which frees the worker's request at its next step.
// /v1/models answers without a token, as llama.cpp's server does: it names
// the model and nothing else.
//
// Threads: one. libevent's evhttp serves every connection from one event loop
// thread (no thread per connection or stream); the gRPC calls use the callback
// API, whose callbacks hand each message to the loop through a task queue and
// an eventfd. Thread-safety: Start and Stop from one thread (ServerProcess);
// everything else runs on the loop thread.
#ifndef KVCACHE_ROUTER_HTTP_GATEWAY_H_
#define KVCACHE_ROUTER_HTTP_GATEWAY_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/server.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "kvcache/v1/router.grpc.pb.h"
#include "router/auth.h"

struct event;
struct event_base;
struct evhttp;
struct evhttp_bound_socket;
struct evhttp_request;

namespace kvcache::router {

struct HttpGatewayOptions {
  // host:port; port 0 picks a free port.
  std::string listen = "127.0.0.1:0";
  // The names `model` may take (the first is reported when a request names
  // none). REQUIRES: not empty.
  std::vector<std::string> model_names;
  // Deadline of a request that sends no x-request-timeout-ms header.
  absl::Duration request_timeout = absl::Minutes(10);
  // Larger request bodies get 413.
  size_t max_body_bytes = 8 << 20;
  // A keep-alive connection idle this long is closed.
  absl::Duration idle_timeout = absl::Minutes(5);
  // The router's client tokens (or null): a request's Authorization header is
  // checked before its body is read, so a caller without a valid token gets 401
  // whatever it sent, and learns nothing of the served models or of what its
  // body lacks. The router checks the forwarded call again.
  const Authenticator* auth = nullptr;
  // Called (loop thread) with the status of each completion request the
  // gateway refuses itself (authentication, the body, the model, its headers)
  // before any gRPC call: the router's kvcache_router_requests_total counts
  // them as it counts the calls it refuses.
  std::function<void(absl::StatusCode)> on_refused;
};

class HttpGateway final : public ServerProcess::Frontend {
 public:
  explicit HttpGateway(HttpGatewayOptions options);
  ~HttpGateway() override;  // Stop()

  // Binds the listening socket and starts the loop thread; `channel` reaches
  // the router's services. Returns "http=HOST:PORT". UNAVAILABLE when the
  // address cannot be bound.
  absl::StatusOr<std::string> Start(std::shared_ptr<grpc::Channel> channel) override;
  // Answers new requests 503 "the router is shutting down" (the listening
  // socket stays open, so probes and clients get that answer), and waits until
  // the running calls end or `deadline` passes.
  void Drain(absl::Time deadline) override;
  // Stops accepting, cancels calls still running, waits for every call to
  // end, answers what is pending, and joins the loop. Idempotent.
  void Stop() override;

  int port() const { return port_; }

 private:
  class Pending;
  class Exchange;
  class HealthProbe;

  // The listening socket on host:port (nullptr and errno on failure).
  evhttp_bound_socket* Listen(const std::string& host, int port);
  // Runs `task` on the loop thread (from any thread).
  void Post(absl::AnyInvocable<void()> task);
  void RunTasks();
  void CallStarted();
  void CallEnded();

  // Loop thread.
  void OnRequest(evhttp_request* req);
  void HandleGenerate(evhttp_request* req, bool chat);
  static void OnRequestCallback(evhttp_request* req, void* self);
  static void OnWake(int fd, short what, void* self);
  // evhttp sent the whole reply of a request (its last byte left).
  static void OnReplySent(evhttp_request* req, void* self);
  // A request leaves unsent_: sent (OnReplySent), or dropped with its client.
  void ReplyDone();
  // Leaves the loop once every reply was sent (or at the stop's bound).
  void BreakWhenSent();

  const HttpGatewayOptions options_;
  const int64_t created_;  // Unix seconds, for /v1/models
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::KvCache::Stub> stub_;
  std::unique_ptr<grpc::health::v1::Health::Stub> health_stub_;

  event_base* base_ = nullptr;
  evhttp* http_ = nullptr;
  evhttp_bound_socket* bound_ = nullptr;
  event* wake_event_ = nullptr;
  int wake_fd_ = -1;
  int port_ = 0;
  std::thread loop_;

  // Loop thread only.
  bool stopping_ = false;
  // Requests whose reply evhttp has not finished sending (OnReplySent), or
  // dropped with their client (Pending): Stop leaves the loop when none is
  // left, so that a stream's last events reach its client. One whose
  // connection fails while its reply is written counts until the stop's bound.
  int64_t unsent_ = 0;
  bool break_when_sent_ = false;
  absl::flat_hash_set<Exchange*> exchanges_;
  std::mt19937_64 rng_{std::random_device{}()};

  absl::Mutex mu_;
  std::vector<absl::AnyInvocable<void()>> tasks_ ABSL_GUARDED_BY(mu_);
  // gRPC calls started and not yet done (their last task is queued when done).
  int live_calls_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvcache::router

#endif  // KVCACHE_ROUTER_HTTP_GATEWAY_H_
