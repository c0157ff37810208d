#include "router/http_gateway.h"

#include <arpa/inet.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <event2/http.h>
#include <event2/http_struct.h>
#include <event2/keyvalq_struct.h>
#include <event2/listener.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/notification.h"
#include "common/logging.h"
#include "common/status.h"
#include "router/openai_api.h"

namespace kvcache::router {
namespace {

constexpr char kModelsPath[] = "/v1/models";
// The longest deadline a request may ask for (x-request-timeout-ms).
constexpr int64_t kMaxRequestTimeoutMs = int64_t{24} * 3600 * 1000;

const char* ReasonPhrase(int code) {
  switch (code) {
    case 200:
      return "OK";
    case 400:
      return "Bad Request";
    case 401:
      return "Unauthorized";
    case 403:
      return "Forbidden";
    case 404:
      return "Not Found";
    case 405:
      return "Method Not Allowed";
    case 409:
      return "Conflict";
    case 429:
      return "Too Many Requests";
    case 499:
      return "Client Closed Request";
    case 503:
      return "Service Unavailable";
    case 504:
      return "Gateway Timeout";
    default:
      return "Internal Server Error";
  }
}

void SendBody(evhttp_request* req, int code, absl::string_view content_type, absl::string_view body) {
  evkeyvalq* headers = evhttp_request_get_output_headers(req);
  evhttp_add_header(headers, "Content-Type", std::string(content_type).c_str());
  evbuffer* buf = evbuffer_new();
  evbuffer_add(buf, body.data(), body.size());
  evhttp_send_reply(req, code, ReasonPhrase(code), buf);
  evbuffer_free(buf);
}

void SendJson(evhttp_request* req, int code, absl::string_view body) {
  SendBody(req, code, "application/json", body);
}

void SendError(evhttp_request* req, const absl::Status& status, absl::string_view code = "") {
  SendJson(req, openai::HttpStatusFor(status.code()), openai::ErrorJson(status, code));
}

const char* Header(evhttp_request* req, const char* name) {
  return evhttp_find_header(evhttp_request_get_input_headers(req), name);
}

// Content-Length headers that disagree, or one beside Transfer-Encoding, frame
// the body two ways (RFC 9112 section 6.3): libevent reads the first, a proxy
// in front may have read another, and the rest of the body would be taken
// for the next request on the connection (request smuggling).
bool AmbiguousLength(evhttp_request* req) {
  const char* length = nullptr;
  bool chunked = false;
  for (const evkeyval* h = evhttp_request_get_input_headers(req)->tqh_first; h != nullptr;
       h = h->next.tqe_next) {
    if (absl::EqualsIgnoreCase(h->key, "Transfer-Encoding")) chunked = true;
    if (!absl::EqualsIgnoreCase(h->key, "Content-Length")) continue;
    if (length != nullptr && std::strcmp(length, h->value) != 0) return true;
    length = h->value;
  }
  return chunked && length != nullptr;
}

// Splits "host:port" ("[v6]:port" too).
absl::Status SplitHostPort(const std::string& address, std::string* host, int* port) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || !absl::SimpleAtoi(address.substr(colon + 1), port) || *port < 0 ||
      *port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("--http_listen='", address, "': want host:port"));
  }
  *host = address.substr(0, colon);
  if (host->size() >= 2 && host->front() == '[' && host->back() == ']')
    *host = host->substr(1, host->size() - 2);
  return absl::OkStatus();
}

// Keep-alive connections are file descriptors: thousands of them need the
// hard limit, not the (often 1,024) soft one.
void RaiseFileLimit() {
  rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
    const rlim_t before = rl.rlim_cur;
    rl.rlim_cur = rl.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &rl) == 0) {
      KV_LOG_INFO("http: open files limit raised from {} to {}", before, rl.rlim_max);
    }
  }
}

}  // namespace

// One HTTP request answered asynchronously: watches its connection, so that
// a client that goes away is noticed (OnClientGone) and the request is freed
// the right way. evhttp notices a closed connection only when it writes; an
// event on the socket notices it at once, also while nothing is written: a
// close as EV_CLOSED (EPOLLRDHUP), a reset as readable (libevent's epoll
// backend reports EPOLLHUP / EPOLLERR as EV_READ | EV_WRITE, never EV_CLOSED),
// which PeerGone tells from bytes of a next request. Loop thread only.
class HttpGateway::Pending {
 public:
  Pending(HttpGateway* gateway, evhttp_request* req) : gateway_(gateway), req_(req) {
    evcon_ = evhttp_request_get_connection(req);
    evhttp_connection_set_closecb(evcon_, &Pending::OnConnectionFreed, this);
    fd_ = bufferevent_getfd(evhttp_connection_get_bufferevent(evcon_));
    Watch(EV_READ | EV_CLOSED);
  }
  virtual ~Pending() = default;

 protected:
  bool client_gone() const { return client_gone_; }
  evhttp_request* req() const { return req_; }

  // Hands the request back to evhttp: answered by `respond` (which sends the
  // whole reply or ends the stream), or dropped when the client is gone.
  template <typename Respond>
  void Release(Respond respond) {
    if (released_) return;
    released_ = true;
    if (detached_) {  // evhttp freed the connection and left the request to us
      evhttp_request_free(req_);
      gateway_->ReplyDone();
      return;
    }
    evhttp_connection_set_closecb(evcon_, nullptr, nullptr);
    StopWatching();
    if (client_gone_) {
      evhttp_connection_free(evcon_);  // frees the request too
      gateway_->ReplyDone();
      return;
    }
    respond(req_);
  }

  virtual void OnClientGone() = 0;

 private:
  void StopWatching() {
    if (closed_ != nullptr) {
      event_free(closed_);
      closed_ = nullptr;
    }
  }

  void Gone() {
    if (client_gone_) return;
    client_gone_ = true;
    OnClientGone();
  }

  void Watch(short what) {
    closed_ = event_new(gateway_->base_, fd_, what, &Pending::OnPeer, this);
    event_add(closed_, nullptr);
  }

  // The socket's peer closed it or reset it (a pending error, or the end of
  // its bytes); false while it is open, or has bytes to read.
  static bool PeerGone(evutil_socket_t fd, bool* has_bytes) {
    int err = 0;
    socklen_t len = sizeof(err);
    if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err != 0) return true;
    char byte;
    const ssize_t n = recv(fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
    *has_bytes = n > 0;
    return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
  }

  static void OnPeer(evutil_socket_t fd, short what, void* arg) {
    auto* self = static_cast<Pending*>(arg);
    bool has_bytes = false;
    if ((what & EV_CLOSED) != 0 || PeerGone(fd, &has_bytes)) return self->Gone();
    // Bytes of a pipelined request, which evhttp reads after this one: from
    // here only a close is noticed before the reply is written (a readable
    // watch would fire again at once).
    self->StopWatching();
    self->Watch(has_bytes ? EV_CLOSED : EV_READ | EV_CLOSED);
  }

  // evhttp is freeing the connection (it failed under an unanswered request,
  // which evhttp then leaves to us with no connection).
  static void OnConnectionFreed(evhttp_connection*, void* arg) {
    auto* self = static_cast<Pending*>(arg);
    self->detached_ = true;
    self->StopWatching();  // the socket closes next
    self->Gone();
  }

 protected:
  HttpGateway* const gateway_;

 private:
  evhttp_request* const req_;
  evhttp_connection* evcon_ = nullptr;
  evutil_socket_t fd_ = -1;
  event* closed_ = nullptr;  // the watch on fd_
  bool client_gone_ = false;
  bool detached_ = false;
  bool released_ = false;
};

// One completion request: the Generate call (a gRPC callback reactor whose
// callbacks post to the loop) and its HTTP answer (loop thread). It deletes
// itself once both sides are done: gRPC's after OnDone, the loop's after the
// answer.
class HttpGateway::Exchange final : public Pending, public grpc::ClientReadReactor<v1::GenerateResponse> {
 public:
  Exchange(HttpGateway* gateway, evhttp_request* req, openai::ParsedRequest parsed, openai::ResponseMeta meta,
           absl::Time deadline, const char* authorization)
      : Pending(gateway, req),
        stream_(parsed.stream),
        include_usage_(parsed.stream && parsed.include_usage),
        meta_(std::move(meta)),
        deadline_(deadline),
        authorization_(authorization != nullptr ? std::optional<std::string>(authorization) : std::nullopt),
        retry_without_session_(WithoutKeySession(parsed)),
        trimmer_(std::move(parsed.stop)),
        request_(std::move(parsed.generate)) {
    ctx_.set_deadline(absl::ToChronoTime(deadline));
    if (authorization_.has_value()) ctx_.AddMetadata("authorization", *authorization_);
  }

  void Start() {
    gateway_->exchanges_.insert(this);
    gateway_->CallStarted();
    gateway_->stub_->async()->Generate(&ctx_, &request_, this);
    StartRead(&msg_);
    StartCall();
  }

  // Loop thread: the gateway is stopping.
  void Cancel() { ctx_.TryCancel(); }

  // gRPC threads.
  void OnReadDone(bool ok) override {
    if (!ok) return;  // the stream ended: OnDone follows
    gateway_->Post([this, msg = std::move(msg_)]() mutable { OnMessage(&msg); });
    StartRead(&msg_);
  }

  void OnDone(const grpc::Status& status) override {
    gateway_->Post([this, status] { OnUpstreamDone(status); });
    gateway_->CallEnded();
    Unref();
  }

 private:
  void OnClientGone() override { ctx_.TryCancel(); }

  // A session named by prompt_cache_key or user may be busy with another
  // conversation of the same key: such a request can run again without one.
  static std::optional<openai::ParsedRequest> WithoutKeySession(const openai::ParsedRequest& parsed) {
    if (!parsed.session_from_key) return std::nullopt;
    openai::ParsedRequest again = parsed;
    again.generate.clear_session_id();
    again.session_from_key = false;
    return again;
  }

  void Unref() {
    if (refs_.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
  }

  void SendEvent(absl::string_view data) {
    evbuffer* buf = evbuffer_new();
    evbuffer_add(buf, "data: ", 6);
    evbuffer_add(buf, data.data(), data.size());
    evbuffer_add(buf, "\n\n", 2);
    evhttp_send_reply_chunk(req(), buf);
    evbuffer_free(buf);
  }

  void StartStream() {
    if (started_) return;
    started_ = true;
    evkeyvalq* headers = evhttp_request_get_output_headers(req());
    evhttp_add_header(headers, "Content-Type", "text/event-stream");
    evhttp_add_header(headers, "Cache-Control", "no-cache");
    if (req()->major == 1 && req()->minor == 0) {
      // HTTP/1.0 has no chunked encoding: the stream ends with the connection.
      // For a keep-alive client evhttp would announce Content-Length: 0 and
      // then send the events past it, on a connection kept open.
      evhttp_remove_header(evhttp_request_get_input_headers(req()), "Connection");
      evhttp_add_header(headers, "Connection", "close");
    }
    evhttp_send_reply_start(req(), 200, "OK");
    if (meta_.endpoint == openai::Endpoint::kChatCompletions)
      SendEvent(openai::ChunkJson(meta_, "", /*with_role=*/true, nullptr, include_usage_));
  }

  void OnMessage(v1::GenerateResponse* msg) {
    if (client_gone()) return;
    if (msg->has_token()) {
      const std::string text = trimmer_.Push(msg->token().text());
      if (!stream_) {
        text_ += text;
        return;
      }
      StartStream();
      if (!text.empty()) SendEvent(openai::ChunkJson(meta_, text, false, nullptr, include_usage_));
    } else if (msg->has_final()) {
      final_ = msg->final();
    }
  }

  void OnUpstreamDone(const grpc::Status& grpc_status) {
    gateway_->exchanges_.erase(this);
    if (grpc_status.error_code() == grpc::ABORTED && retry_without_session_.has_value() && !started_ &&
        text_.empty() && !gateway_->stopping_) {
      // Refused before its first token: nothing was sent, so it starts over
      // (its prompt's pages still come from the prefix cache).
      Release([&](evhttp_request* req) {
        auto* again = new Exchange(gateway_, req, *std::move(retry_without_session_), meta_, deadline_,
                                   authorization_.has_value() ? authorization_->c_str() : nullptr);
        again->Start();
      });
      Unref();
      return;
    }
    const absl::Status status = FromGrpcStatus(grpc_status);
    Release([&](evhttp_request* req) {
      const v1::FinishReason finish =
          trimmer_.matched() ? v1::FINISH_REASON_STOP_STRING : final_.finish_reason();
      if (!stream_) {
        if (!status.ok()) return SendError(req, status);
        text_ += trimmer_.Flush();
        return SendJson(req, 200, openai::ResponseJson(meta_, text_, finish, final_));
      }
      if (!status.ok() && !started_) return SendError(req, status);
      StartStream();
      if (status.ok()) {
        if (std::string rest = trimmer_.Flush(); !rest.empty())
          SendEvent(openai::ChunkJson(meta_, rest, false, nullptr, include_usage_));
        SendEvent(openai::ChunkJson(meta_, "", false, &finish, include_usage_));
        if (include_usage_) SendEvent(openai::UsageChunkJson(meta_, final_));
      } else {
        SendEvent(openai::ErrorJson(status));  // the status line went out with the first token
      }
      SendEvent("[DONE]");
      evhttp_send_reply_end(req);
    });
    Unref();
  }

  const bool stream_;
  const bool include_usage_;
  const openai::ResponseMeta meta_;
  const absl::Time deadline_;
  const std::optional<std::string> authorization_;
  std::optional<openai::ParsedRequest> retry_without_session_;  // loop thread
  // Loop thread only.
  openai::StopTrimmer trimmer_;
  std::string text_;      // the reply so far (not streaming)
  bool started_ = false;  // the stream's status line and headers went out
  v1::GenerateResponse::Final final_;

  grpc::ClientContext ctx_;
  v1::GenerateRequest request_;
  v1::GenerateResponse msg_;
  // gRPC's until OnDone, and the loop's until the answer.
  std::atomic<int> refs_{2};
};

// /health and /ready: a grpc.health.v1 Check of the router itself.
class HttpGateway::HealthProbe final : public Pending {
 public:
  HealthProbe(HttpGateway* gateway, evhttp_request* req, const char* service) : Pending(gateway, req) {
    request_.set_service(service);
    ctx_.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  }

  void Start() {
    gateway_->CallStarted();
    HttpGateway* gateway = gateway_;  // the task may delete `this` before CallEnded
    gateway->health_stub_->async()->Check(&ctx_, &request_, &response_, [this, gateway](grpc::Status status) {
      gateway->Post([this, status] { Done(status); });
      gateway->CallEnded();
    });
  }

 private:
  void OnClientGone() override { ctx_.TryCancel(); }

  void Done(const grpc::Status& status) {
    Release([&](evhttp_request* req) {
      const bool serving =
          status.ok() && response_.status() == grpc::health::v1::HealthCheckResponse::SERVING;
      const std::string name =
          status.ok() ? grpc::health::v1::HealthCheckResponse::ServingStatus_Name(response_.status())
                      : "NOT_SERVING";
      SendJson(req, serving ? 200 : 503, absl::StrCat("{\"status\":\"", name, "\"}"));
    });
    delete this;
  }

  grpc::ClientContext ctx_;
  grpc::health::v1::HealthCheckRequest request_;
  grpc::health::v1::HealthCheckResponse response_;
};

HttpGateway::HttpGateway(HttpGatewayOptions options)
    : options_(std::move(options)), created_(absl::ToUnixSeconds(absl::Now())) {}

HttpGateway::~HttpGateway() { Stop(); }

absl::StatusOr<std::string> HttpGateway::Start(std::shared_ptr<grpc::Channel> channel) {
  if (options_.model_names.empty()) return absl::InvalidArgumentError("the HTTP API needs a model name");
  std::string host;
  int port = 0;
  KVCACHE_RETURN_IF_ERROR(SplitHostPort(options_.listen, &host, &port));
  RaiseFileLimit();
  channel_ = std::move(channel);
  stub_ = v1::KvCache::NewStub(channel_);
  health_stub_ = grpc::health::v1::Health::NewStub(channel_);

  base_ = event_base_new();
  if (base_ == nullptr) return absl::InternalError("event_base_new failed");
  if ((event_base_get_features(base_) & EV_FEATURE_EARLY_CLOSE) == 0) {
    KV_LOG_WARN(
        "http: the event backend cannot watch for closed connections; a client that goes away is "
        "noticed at the next token written");
  }
  http_ = evhttp_new(base_);
  evhttp_set_max_body_size(http_, static_cast<ev_ssize_t>(options_.max_body_bytes));
  evhttp_set_max_headers_size(http_, 64 << 10);
  evhttp_set_timeout(http_,
                     static_cast<int>(std::max<int64_t>(1, absl::ToInt64Seconds(options_.idle_timeout))));
  // Every method reaches OnRequest, which answers the ones a path does not take
  // with a JSON 405 (libevent's own answer to the rest is an HTML 501).
  evhttp_set_allowed_methods(http_, EVHTTP_REQ_GET | EVHTTP_REQ_POST | EVHTTP_REQ_HEAD | EVHTTP_REQ_PUT |
                                        EVHTTP_REQ_DELETE | EVHTTP_REQ_OPTIONS | EVHTTP_REQ_TRACE |
                                        EVHTTP_REQ_PATCH);
  evhttp_set_gencb(http_, &HttpGateway::OnRequestCallback, this);
  bound_ = Listen(host, port);
  wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (bound_ == nullptr || wake_fd_ < 0) {
    const std::string why = std::strerror(errno);
    if (wake_fd_ >= 0) close(wake_fd_);
    wake_fd_ = -1;
    evhttp_free(http_);
    event_base_free(base_);
    http_ = nullptr;
    base_ = nullptr;
    return absl::UnavailableError(absl::StrCat("cannot listen for HTTP on ", options_.listen, ": ", why));
  }
  sockaddr_storage addr;
  socklen_t len = sizeof(addr);
  if (getsockname(evhttp_bound_socket_get_fd(bound_), reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port_ = ntohs(addr.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port
                                             : reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  }
  wake_event_ = event_new(base_, wake_fd_, EV_READ | EV_PERSIST, &HttpGateway::OnWake, this);
  event_add(wake_event_, nullptr);
  loop_ = std::thread([this] { event_base_loop(base_, EVLOOP_NO_EXIT_ON_EMPTY); });
  KV_LOG_INFO("http: OpenAI-compatible API on {}:{} (models: {})", host, port_,
              absl::StrJoin(options_.model_names, ", "));
  const std::string shown = absl::StrContains(host, ':') ? absl::StrCat("[", host, "]") : host;
  return absl::StrCat("http=", shown, ":", port_);
}

evhttp_bound_socket* HttpGateway::Listen(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.empty() ? nullptr : host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0 ||
      found == nullptr) {
    errno = EADDRNOTAVAIL;
    return nullptr;
  }
  // evhttp_bind_socket's backlog (128) drops connections that arrive together
  // by the thousand; the kernel caps this one at net.core.somaxconn.
  evconnlistener* listener = evconnlistener_new_bind(
      base_, nullptr, nullptr, LEV_OPT_REUSEABLE | LEV_OPT_CLOSE_ON_FREE | LEV_OPT_CLOSE_ON_EXEC,
      /*backlog=*/4096, found->ai_addr, static_cast<int>(found->ai_addrlen));
  freeaddrinfo(found);
  return listener == nullptr ? nullptr : evhttp_bind_listener(http_, listener);
}

void HttpGateway::Drain(absl::Time deadline) {
  if (!loop_.joinable()) return;
  // Once this task ran, no request starts a call (the loop answers it 503).
  absl::Notification refusing;
  Post([this, &refusing] {
    stopping_ = true;
    refusing.Notify();
  });
  refusing.WaitForNotification();
  absl::MutexLock lock(&mu_);
  mu_.AwaitWithDeadline(absl::Condition(
                            +[](int* live) { return *live == 0; }, &live_calls_),
                        deadline);
  if (live_calls_ > 0) KV_LOG_WARN("http: {} calls still running at the shutdown deadline", live_calls_);
}

void HttpGateway::Stop() {
  if (!loop_.joinable()) return;
  Post([this] {
    stopping_ = true;
    if (bound_ != nullptr) evhttp_del_accept_socket(http_, bound_);
    bound_ = nullptr;
    for (Exchange* e : exchanges_) e->Cancel();
  });
  {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](int* live) { return *live == 0; }, &live_calls_));
  }
  // Every call's last task is queued ahead of this one.
  Post([this] { BreakWhenSent(); });
  loop_.join();
  // The in-process channel goes before the server it reaches (ServerProcess
  // stops and destroys that server next).
  health_stub_.reset();
  stub_.reset();
  channel_.reset();
  evhttp_free(http_);  // closes the idle connections
  event_free(wake_event_);
  event_base_free(base_);
  close(wake_fd_);
  http_ = nullptr;
  wake_event_ = nullptr;
  base_ = nullptr;
  wake_fd_ = -1;
}

void HttpGateway::Post(absl::AnyInvocable<void()> task) {
  bool wake;
  {
    absl::MutexLock lock(&mu_);
    wake = tasks_.empty();
    tasks_.push_back(std::move(task));
  }
  if (wake) {
    const uint64_t one = 1;
    (void)!write(wake_fd_, &one, sizeof(one));
  }
}

void HttpGateway::OnWake(int fd, short, void* self) {
  uint64_t n;
  (void)!read(fd, &n, sizeof(n));
  static_cast<HttpGateway*>(self)->RunTasks();
}

void HttpGateway::RunTasks() {
  std::vector<absl::AnyInvocable<void()>> tasks;
  {
    absl::MutexLock lock(&mu_);
    tasks.swap(tasks_);
  }
  for (auto& t : tasks) std::move(t)();
}

void HttpGateway::CallStarted() {
  absl::MutexLock lock(&mu_);
  ++live_calls_;
}

void HttpGateway::CallEnded() {
  absl::MutexLock lock(&mu_);
  --live_calls_;
}

namespace {

// The request's path, runs of '/' merged (as nginx's merge_slashes does): a
// client that joins "http://host/" and "/v1/completions" sends "//v1/...", which
// libevent's parsed URI reads as an authority ("v1") and a path "/completions".
// Absolute-form targets ("http://host/v1/...") take libevent's parse.
std::string RequestPath(evhttp_request* req) {
  const char* target = evhttp_request_get_uri(req);
  if (target == nullptr || target[0] != '/') {
    const evhttp_uri* uri = evhttp_request_get_evhttp_uri(req);
    const char* raw = uri == nullptr ? nullptr : evhttp_uri_get_path(uri);
    return raw == nullptr ? "" : raw;
  }
  std::string path;
  for (const char* p = target; *p != '\0' && *p != '?' && *p != '#'; ++p) {
    if (*p == '/' && !path.empty() && path.back() == '/') continue;
    path.push_back(*p);
  }
  return path;
}

}  // namespace

void HttpGateway::OnRequestCallback(evhttp_request* req, void* self) {
  static_cast<HttpGateway*>(self)->OnRequest(req);
}

void HttpGateway::OnReplySent(evhttp_request*, void* self) { static_cast<HttpGateway*>(self)->ReplyDone(); }

void HttpGateway::ReplyDone() {
  --unsent_;
  if (break_when_sent_ && unsent_ <= 0) event_base_loopbreak(base_);
}

void HttpGateway::BreakWhenSent() {
  if (unsent_ <= 0) {
    event_base_loopbreak(base_);
    return;
  }
  // Replies answered but still in evhttp's buffers (a stream's last events,
  // written by the tasks before this one) go out first, within a bound for
  // clients that stopped reading.
  break_when_sent_ = true;
  const timeval bound = {1, 0};
  event_base_loopexit(base_, &bound);
}

void HttpGateway::OnRequest(evhttp_request* req) {
  ++unsent_;
  evhttp_request_set_on_complete_cb(req, &HttpGateway::OnReplySent, this);
  // Tokens leave as they come: no waiting for a full segment.
  evhttp_connection* evcon = evhttp_request_get_connection(req);
  const int one = 1;
  setsockopt(bufferevent_getfd(evhttp_connection_get_bufferevent(evcon)), IPPROTO_TCP, TCP_NODELAY, &one,
             sizeof(one));
  if (AmbiguousLength(req)) {
    // Closed after the answer, so that nothing after this request is read.
    evhttp_add_header(evhttp_request_get_output_headers(req), "Connection", "close");
    return SendError(req, absl::InvalidArgumentError(
                              "the request's length is ambiguous (Content-Length headers that disagree, or "
                              "one beside Transfer-Encoding)"));
  }
  const std::string path = RequestPath(req);
  const evhttp_cmd_type method = evhttp_request_get_command(req);
  // HEAD is GET without the body (libevent drops it).
  const bool get = method == EVHTTP_REQ_GET || method == EVHTTP_REQ_HEAD, post = method == EVHTTP_REQ_POST;
  if (stopping_) return SendError(req, absl::UnavailableError("the router is shutting down"));

  auto wrong_method = [&](const char* want) {
    evhttp_add_header(evhttp_request_get_output_headers(req), "Allow", want);
    SendJson(req, 405,
             openai::ErrorJson(absl::InvalidArgumentError(absl::StrCat(path, " takes ", want)),
                               "method_not_allowed"));
  };
  if (path == "/v1/chat/completions" || path == "/v1/completions") {
    if (!post) return wrong_method("POST");
    return HandleGenerate(req, path == "/v1/chat/completions");
  }
  if (path == "/health" || path == "/ready") {
    if (!get) return wrong_method("GET");
    auto* probe = new HealthProbe(this, req, path == "/health" ? kLivenessService : kReadinessService);
    return probe->Start();
  }
  if (path == kModelsPath) {
    if (!get) return wrong_method("GET");
    return SendJson(req, 200, openai::ModelsJson(options_.model_names, created_));
  }
  if (absl::StartsWith(path, absl::StrCat(kModelsPath, "/"))) {
    if (!get) return wrong_method("GET");
    // Ids such as "HuggingFaceTB/SmolLM2-135M-Instruct" arrive percent-encoded.
    char* decoded = evhttp_uridecode(path.c_str() + sizeof(kModelsPath), /*decode_plus=*/0, nullptr);
    const std::string name = decoded != nullptr ? decoded : "";
    std::free(decoded);
    if (std::find(options_.model_names.begin(), options_.model_names.end(), name) ==
        options_.model_names.end()) {
      return SendError(req, absl::NotFoundError(absl::StrCat("The model '", name, "' does not exist")),
                       "model_not_found");
    }
    return SendJson(req, 200, openai::ModelJson(name, created_));
  }
  SendError(req, absl::NotFoundError(absl::StrCat("no route for ", path)));
}

void HttpGateway::HandleGenerate(evhttp_request* req, bool chat) {
  const openai::Endpoint endpoint =
      chat ? openai::Endpoint::kChatCompletions : openai::Endpoint::kCompletions;
  evbuffer* input = evhttp_request_get_input_buffer(req);
  const size_t size = evbuffer_get_length(input);
  const char* body = size == 0 ? "" : reinterpret_cast<const char*>(evbuffer_pullup(input, -1));
  // Forwarded as is: the router reads it exactly as it reads gRPC metadata.
  // Refused here, before the router sees the call: counted as it counts those.
  auto refuse = [&](const absl::Status& status, absl::string_view code = "") {
    if (options_.on_refused) options_.on_refused(status.code());
    SendError(req, status, code);
  };
  const char* authorization = Header(req, "Authorization");
  if (authorization != nullptr && !std::all_of(authorization, authorization + std::strlen(authorization),
                                               [](char c) { return c >= 0x20 && c < 0x7f; })) {
    return refuse(absl::UnauthenticatedError("malformed Authorization header"));
  }
  if (options_.auth != nullptr) {
    absl::StatusOr<Principal> who = options_.auth->Authenticate(
        authorization == nullptr ? std::nullopt : std::optional<absl::string_view>(authorization),
        /*need_admin=*/false);
    if (!who.ok()) return refuse(who.status());
  }
  const char* session = Header(req, "x-session-id");
  absl::StatusOr<openai::ParsedRequest> parsed =
      openai::ParseRequest(endpoint, absl::string_view(body, size),
                           session == nullptr ? std::nullopt : std::optional<absl::string_view>(session));
  if (!parsed.ok()) return refuse(parsed.status());

  openai::ResponseMeta meta;
  meta.endpoint = endpoint;
  meta.created = absl::ToUnixSeconds(absl::Now());
  meta.model = parsed->model.empty() ? options_.model_names.front() : parsed->model;
  if (std::find(options_.model_names.begin(), options_.model_names.end(), meta.model) ==
      options_.model_names.end()) {
    absl::Status st = absl::NotFoundError(
        absl::StrCat("The model '", meta.model,
                     "' does not exist (served: ", absl::StrJoin(options_.model_names, ", "), ")"));
    return refuse(st, "model_not_found");
  }
  meta.id = openai::NewResponseId(endpoint, rng_(), rng_());
  // Without a seed, sampling is random per request, as OpenAI's is (the wire's
  // seed 0 would derive it from the session id: the same text on every retry).
  v1::SamplingParams* sampling = parsed->generate.mutable_sampling();
  if (sampling->seed() == 0) sampling->set_seed(rng_() | 1);

  absl::Duration timeout = options_.request_timeout;
  if (const char* t = Header(req, "x-request-timeout-ms"); t != nullptr) {
    int64_t ms = 0;
    if (!absl::SimpleAtoi(t, &ms) || ms <= 0 || ms > kMaxRequestTimeoutMs) {
      return refuse(absl::InvalidArgumentError(
          absl::StrCat("x-request-timeout-ms must be a whole number of milliseconds in [1, ",
                       kMaxRequestTimeoutMs, "] (24 hours), got '", t, "'")));
    }
    timeout = absl::Milliseconds(ms);
  }
  auto* exchange =
      new Exchange(this, req, *std::move(parsed), std::move(meta), absl::Now() + timeout, authorization);
  exchange->Start();
}

}  // namespace kvcache::router
