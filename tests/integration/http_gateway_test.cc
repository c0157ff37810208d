// The router's OpenAI-compatible HTTP front door (--http_listen) with real
// processes over loopback: routes and status codes, and the connection load
// it was built for: 2,000 idle keep-alive connections and 200 concurrent SSE
// streams held by an event loop, with the router's thread count measured
// (no thread per connection or stream).
#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/gguf/tiny_llama.h"
#include "event2/event.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvcache/v1/worker.grpc.pb.h"
#include "nlohmann/json.hpp"
#include "tests/testing/child_process.h"
#include "tests/testing/http_client.h"

namespace kvcache {
namespace {

using ::testing::HasSubstr;
using testing::HttpFetch;
using testing::HttpHeaders;
using testing::HttpResult;
using ::testing::Not;
using Json = nlohmann::json;

// Open file descriptors of process `pid`.
int OpenFiles(pid_t pid) {
  DIR* dir = opendir(absl::StrCat("/proc/", pid, "/fd").c_str());
  if (dir == nullptr) return -1;
  int n = 0;
  while (readdir(dir) != nullptr) ++n;
  closedir(dir);
  return n - 2;  // . and ..
}

class HttpGatewayTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    model_ = new std::string(::testing::TempDir() + "/kvcache_http_gateway_test_tiny.gguf");
    gguf::TinyLlamaOptions o;
    o.n_ctx = 1024;
    ASSERT_TRUE(gguf::WriteTinyLlama(o, *model_).ok());
  }
  static void TearDownTestSuite() {
    std::remove(model_->c_str());
    delete model_;
  }

  void SetUp() override { StartServers(*model_); }

  // A worker and a router serving `model` (the suite's, or another a test
  // needs), replacing any the fixture runs.
  void StartServers(const std::string& model) {
    router_.reset();
    worker_.reset();
    auto w = testing::ServerUnderTest::Start(
        testing::BinaryPath("worker/kvcache-worker"),
        {"--model=" + model, "--worker_id=w0", "--threads=1", "--load_report_interval=100ms",
         "--max_running=256", "--max_batch_tokens=8192"});
    ASSERT_TRUE(w.ok()) << w.status();
    worker_ = std::move(*w);
    auto r = testing::ServerUnderTest::Start(
        testing::BinaryPath("router/kvcache-router"),
        {"--workers=" + worker_->grpc_address(), "--model=" + model, "--rebalance_interval=0s",
         "--http_listen=127.0.0.1:0", "--served_model_name=tiny, tiny-alias"});
    ASSERT_TRUE(r.ok()) << r.status();
    router_ = std::move(*r);
    // The listening line: "kvcache-router listening grpc=... metrics=... http=127.0.0.1:PORT".
    const std::string& out = router_->process().output();
    const size_t at = out.find(" http=127.0.0.1:");
    ASSERT_NE(at, std::string::npos) << out;
    const std::string rest = out.substr(at + 16);
    ASSERT_TRUE(absl::SimpleAtoi(rest.substr(0, rest.find_first_not_of("0123456789")), &port_)) << out;
    ASSERT_GT(port_, 0);
  }

  static std::string* model_;
  std::unique_ptr<testing::ServerUnderTest> worker_;
  std::unique_ptr<testing::ServerUnderTest> router_;
  int port_ = 0;
};

std::string* HttpGatewayTest::model_ = nullptr;

int Count(const std::string& s, const std::string& needle) {
  int n = 0;
  for (size_t at = s.find(needle); at != std::string::npos; at = s.find(needle, at + needle.size())) ++n;
  return n;
}

std::string StreamBody(int seed, int max_tokens) {
  Json ids = Json::array();
  for (int i = 0; i < 24; ++i) ids.push_back(100 + (seed * 37 + i * 11) % 200);
  return Json{{"model", "tiny"},  {"prompt", ids},  {"max_tokens", max_tokens},
              {"temperature", 0}, {"stream", true}, {"ignore_eos", true}}
      .dump();
}

TEST_F(HttpGatewayTest, RoutesAndStatuses) {
  HttpResult models = HttpFetch(port_, "GET", "/v1/models");
  EXPECT_EQ(models.status, 200);
  Json m = Json::parse(models.body);
  ASSERT_EQ(m["data"].size(), 2u);
  EXPECT_EQ(m["data"][0]["id"], "tiny");
  EXPECT_EQ(m["data"][1]["id"], "tiny-alias");
  EXPECT_EQ(HttpFetch(port_, "GET", "/v1/models/tiny-alias").status, 200);
  // Ids arrive percent-encoded (the SDK encodes a '/' in "org/model" so).
  EXPECT_EQ(HttpFetch(port_, "GET", "/v1/models/tiny%2Dalias").status, 200);
  EXPECT_EQ(HttpFetch(port_, "HEAD", "/health").status, 200);
  // A session header that is not UTF-8 is the client's error, named as such.
  HttpResult latin1 = HttpFetch(port_, "POST", "/v1/completions", R"({"prompt": [5], "max_tokens": 1})",
                                {{"x-session-id", "\xfcn"}});
  EXPECT_EQ(latin1.status, 400) << latin1.body;
  EXPECT_THAT(latin1.body, HasSubstr("x-session-id"));
  EXPECT_EQ(HttpFetch(port_, "GET", "/v1/models/nope").status, 404);
  EXPECT_EQ(HttpFetch(port_, "GET", "/health").status, 200);
  EXPECT_EQ(HttpFetch(port_, "GET", "/ready").status, 200);
  HttpResult wrong_method = HttpFetch(port_, "GET", "/v1/chat/completions");
  EXPECT_EQ(wrong_method.status, 405);
  EXPECT_THAT(wrong_method.body, HasSubstr("\"error\""));
  // Methods libevent does not take by default get the same JSON answer.
  for (const char* method : {"OPTIONS", "PATCH", "TRACE", "PUT", "DELETE"}) {
    HttpResult r = HttpFetch(port_, method, "/v1/chat/completions", method[0] == 'P' ? "{}" : "");
    EXPECT_EQ(r.status, 405) << method << ": " << r.body;
    EXPECT_EQ(Json::parse(r.body, nullptr, false)["error"]["code"], "method_not_allowed") << method;
  }
  EXPECT_EQ(HttpFetch(port_, "GET", "/nowhere").status, 404);
  // A base URL with a trailing slash joined to "/v1/...": the same route (it was
  // read as host "v1" and path "/completions", 404).
  HttpResult doubled = HttpFetch(port_, "POST", "//v1/completions", R"({"prompt": [5, 6], "max_tokens": 1})");
  EXPECT_EQ(doubled.status, 200) << doubled.body;
  EXPECT_EQ(HttpFetch(port_, "GET", "/v1//models?x=1").status, 200);

  // A request without a model gets the first name; the alias is echoed.
  HttpResult plain = HttpFetch(port_, "POST", "/v1/completions",
                               R"({"prompt": [5, 6, 7], "max_tokens": 3, "ignore_eos": true})");
  ASSERT_EQ(plain.status, 200) << plain.body;
  Json p = Json::parse(plain.body);
  EXPECT_EQ(p["model"], "tiny");
  EXPECT_EQ(p["usage"]["completion_tokens"], 3);
  EXPECT_EQ(p["usage"]["prompt_tokens"], 3);
  HttpResult alias = HttpFetch(port_, "POST", "/v1/completions",
                               R"({"model": "tiny-alias", "prompt": [5], "max_tokens": 1})");
  EXPECT_EQ(Json::parse(alias.body)["model"], "tiny-alias");

  // The router's own validation, as OpenAI errors: a token id outside the vocabulary.
  HttpResult bad = HttpFetch(port_, "POST", "/v1/completions", R"({"prompt": [999999], "max_tokens": 1})");
  EXPECT_EQ(bad.status, 400);
  EXPECT_EQ(Json::parse(bad.body)["error"]["type"], "invalid_request_error");
  // Hostile bodies: not JSON, a deep nesting.
  EXPECT_EQ(HttpFetch(port_, "POST", "/v1/chat/completions", "\x01\x02{{").status, 400);
  EXPECT_EQ(HttpFetch(port_, "POST", "/v1/chat/completions", std::string(200000, '[')).status, 400);
  EXPECT_EQ(HttpFetch(port_, "GET", "/health").status, 200) << "the router survived them";

  // A token the router does not know is 401 whatever the body holds: the caller
  // learns neither what its body lacks nor which models are served (the body
  // was read first: 400 and 404 with the served names).
  const HttpHeaders stranger = {{"Authorization", "Bearer not-a-token-of-this-router"}};
  for (const std::string& body : {std::string("\x01\x02{{"), std::string(R"({"n": 2, "prompt": [5]})"),
                                  std::string(R"({"model": "gpt-4", "prompt": [5]})")}) {
    HttpResult r = HttpFetch(port_, "POST", "/v1/completions", body, stranger);
    EXPECT_EQ(r.status, 401) << body << ": " << r.body;
    EXPECT_THAT(r.body, Not(HasSubstr("tiny"))) << body;
  }
  HttpResult admin = HttpFetch(port_, "POST", "/v1/completions", R"({"prompt": [5], "max_tokens": 1})",
                               {{"Authorization", absl::StrCat("Bearer ", testing::kTestAdminToken)}});
  EXPECT_EQ(admin.status, 200) << admin.body;
}

// A raw socket, so that the test decides when the connection closes.
class RawClient {
 public:
  explicit RawClient(int port) : fd_(socket(AF_INET, SOCK_STREAM, 0)) {
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    timeval tv{30, 0};
    setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    connected_ = connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  }
  ~RawClient() { Close(); }
  bool Send(const std::string& bytes) {
    return connected_ &&
           send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(bytes.size());
  }
  // Reads until the server closes the connection; false if the read times out.
  bool ReadToEnd() {
    char buf[4096];
    for (;;) {
      const ssize_t n = recv(fd_, buf, sizeof(buf), 0);
      if (n == 0) return true;
      if (n < 0) return false;
      received_.append(buf, static_cast<size_t>(n));
    }
  }
  bool Post(const std::string& path, const std::string& body) {
    const std::string req =
        absl::StrCat("POST ", path, " HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n",
                     "Content-Length: ", body.size(), "\r\n\r\n", body);
    return connected_ && send(fd_, req.data(), req.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(req.size());
  }
  // Reads until `needle` occurs `times` times in what arrived (or the read times out).
  bool ReadUntil(const std::string& needle, int times) {
    char buf[4096];
    while (Count(received_, needle) < times) {
      const ssize_t n = recv(fd_, buf, sizeof(buf), 0);
      if (n <= 0) return false;
      received_.append(buf, static_cast<size_t>(n));
    }
    return true;
  }
  void Close() {
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
  }
  // Closes with a reset (RST) instead of a FIN, as a client closing with an
  // unread reply, or a proxy aborting, does.
  void Reset() {
    const linger abort{1, 0};
    setsockopt(fd_, SOL_SOCKET, SO_LINGER, &abort, sizeof(abort));
    Close();
  }
  const std::string& received() const { return received_; }

 private:
  int fd_;
  bool connected_ = false;
  std::string received_;
};

TEST_F(HttpGatewayTest, AClientThatGoesAwayCancelsTheWorkersRequest) {
  RawClient client(port_);
  ASSERT_TRUE(client.Post("/v1/completions", StreamBody(7, 900)));
  ASSERT_TRUE(client.ReadUntil("data: ", 4)) << client.received();
  EXPECT_THAT(client.received(), HasSubstr("HTTP/1.1 200 OK"));
  client.Close();  // mid-stream: 900 tokens were asked for
  // The worker's load reports (every 100 ms) are the clock: once it runs
  // nothing, its request counter says how the stream ended.
  grpc::ClientContext watch_ctx;
  watch_ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  auto watch = v1::Worker::NewStub(worker_->channel())->Watch(&watch_ctx, v1::WatchRequest());
  v1::WatchEvent ev;
  std::string metrics;
  while (watch->Read(&ev)) {
    if (!ev.has_snapshot() && !ev.has_load()) continue;
    const v1::WorkerLoad& load = ev.has_snapshot() ? ev.snapshot().load() : ev.load();
    if (load.running_requests() + load.waiting_requests() > 0) continue;
    metrics = testing::HttpGet(worker_->metrics_port(), "/metrics").value_or("");
    if (metrics.find("kvcache_requests_total{code=") != std::string::npos) break;
  }
  watch_ctx.TryCancel();
  watch->Finish();
  EXPECT_THAT(metrics, HasSubstr("kvcache_requests_total{code=\"CANCELLED\"} 1"));
  EXPECT_THAT(metrics, ::testing::Not(HasSubstr("kvcache_requests_total{code=\"OK\"}")));
  EXPECT_EQ(HttpFetch(port_, "GET", "/ready").status, 200) << "the router carries on";
}

// The same with a client that resets its connection while its reply is not
// streamed (nothing is written to it until the end): libevent's epoll backend
// reports a reset as readable and writable, not EV_CLOSED. Before, the request
// ran to max_tokens for nobody, holding its tenant's request slot and its
// session (qa21: 6 of 6).
TEST_F(HttpGatewayTest, AClientThatResetsItsConnectionCancelsTheWorkersRequest) {
  // A model slow enough that the request (to the end of its 1,024-token
  // context) outlasts a load report: on the suite's, it could run between two
  // of them on an idle machine, and the test waited for a busy one in vain.
  const std::string slow = ::testing::TempDir() + "/kvcache_http_gateway_test_slow.gguf";
  gguf::TinyLlamaOptions o = gguf::SmolLM2ShapedOptions();
  o.n_layer = 4;
  o.n_ctx = 1024;
  ASSERT_TRUE(gguf::WriteTinyLlama(o, slow).ok());
  ASSERT_NO_FATAL_FAILURE(StartServers(slow));
  grpc::ClientContext watch_ctx;
  watch_ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  auto watch = v1::Worker::NewStub(worker_->channel())->Watch(&watch_ctx, v1::WatchRequest());
  RawClient client(port_);
  Json body = Json::parse(StreamBody(8, 4000));
  body["stream"] = false;
  ASSERT_TRUE(client.Post("/v1/completions", body.dump()));
  // The worker's load reports (every 100 ms) are the clock: reset once it runs
  // the request, then read how it ended once it runs nothing.
  v1::WatchEvent ev;
  bool reset = false;
  std::string metrics;
  while (watch->Read(&ev)) {
    if (!ev.has_snapshot() && !ev.has_load()) continue;
    const v1::WorkerLoad& load = ev.has_snapshot() ? ev.snapshot().load() : ev.load();
    const bool busy = load.running_requests() + load.waiting_requests() > 0;
    if (!reset) {
      if (busy) {
        client.Reset();
        reset = true;
      }
      continue;
    }
    if (busy) continue;
    metrics = testing::HttpGet(worker_->metrics_port(), "/metrics").value_or("");
    if (metrics.find("kvcache_requests_total{code=") != std::string::npos) break;
  }
  watch_ctx.TryCancel();
  watch->Finish();
  ASSERT_TRUE(reset) << "the request never ran";
  EXPECT_THAT(metrics, HasSubstr("kvcache_requests_total{code=\"CANCELLED\"} 1"));
  EXPECT_THAT(metrics, ::testing::Not(HasSubstr("kvcache_requests_total{code=\"OK\"}")));
  EXPECT_EQ(HttpFetch(port_, "GET", "/ready").status, 200) << "the router carries on";
  std::remove(slow.c_str());
}

// SIGTERM lets running streams finish (within --shutdown_deadline) while new
// requests, probes included, are answered 503; the router then exits 0.
TEST_F(HttpGatewayTest, ShutdownFinishesRunningStreamsAndAnswersNewRequests503) {
  RawClient stream(port_);
  ASSERT_TRUE(stream.Post("/v1/completions", StreamBody(5, 900)));
  ASSERT_TRUE(stream.ReadUntil("data: ", 4)) << stream.received();
  router_->process().Signal(SIGTERM);
  // The gateway refuses new work once the router's shutdown reached it.
  HttpResult probe;
  ASSERT_TRUE(testing::WaitUntil([&] {
    probe = HttpFetch(port_, "GET", "/health");
    return probe.status == 503 && absl::StrContains(probe.body, "shutting down");
  })) << probe.status
      << " " << probe.body;
  ASSERT_TRUE(stream.ReadUntil("[DONE]", 1)) << stream.received().substr(0, 300);
  EXPECT_THAT(stream.received(), HasSubstr(R"("finish_reason":"length")"));
  EXPECT_THAT(stream.received(), ::testing::Not(HasSubstr("\"error\"")));
  auto exit = router_->process().Wait(absl::Seconds(60));
  ASSERT_TRUE(exit.ok()) << exit.status();
  EXPECT_TRUE(WIFEXITED(*exit) && WEXITSTATUS(*exit) == 0) << *exit;
}

// prompt_cache_key (or user) may be shared by conversations running at once:
// while one streams on the key's session, another with the same key is served
// without a session instead of being refused 409.
TEST_F(HttpGatewayTest, ASharedPromptCacheKeyDoesNotRefuseConcurrentRequests) {
  Json body = Json::parse(StreamBody(3, 900));
  body["prompt_cache_key"] = "team-template-1";
  RawClient first(port_);
  ASSERT_TRUE(first.Post("/v1/completions", body.dump()));
  ASSERT_TRUE(first.ReadUntil("data: ", 4)) << first.received();
  Json second = Json::parse(StreamBody(4, 3));
  second["prompt_cache_key"] = "team-template-1";
  second["stream"] = false;
  HttpResult r = HttpFetch(port_, "POST", "/v1/completions", second.dump());
  EXPECT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(Json::parse(r.body, nullptr, false)["usage"]["completion_tokens"], 3) << r.body;
  EXPECT_TRUE(first.ReadUntil("data: ", 8)) << "the first stream goes on";
  first.Close();
}

TEST_F(HttpGatewayTest, ThousandsOfIdleConnectionsAndHundredsOfStreamsOnFewThreads) {
  constexpr int kIdle = 2000, kStreams = 200;
  // The client's descriptors: 2,200 sockets.
  rlimit rl;
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &rl), 0);
  rl.rlim_cur = rl.rlim_max;
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &rl), 0);
  ASSERT_GE(rl.rlim_cur, static_cast<rlim_t>(kIdle + kStreams + 256))
      << "the hard open-files limit is too low";

  const pid_t pid = router_->process().pid();
  ASSERT_EQ(HttpFetch(port_, "POST", "/v1/completions", StreamBody(0, 2)).status, 200);  // warm
  const int threads_before = testing::ThreadCount(pid);
  const int files_before = OpenFiles(pid);

  event_base* base = event_base_new();
  std::vector<std::unique_ptr<testing::HttpConnection>> idle, streams;
  int idle_ok = 0, idle_done = 0;
  for (int i = 0; i < kIdle; ++i) {
    idle.push_back(std::make_unique<testing::HttpConnection>(base, port_));
    idle.back()->Send("GET", "/health", "", {}, [&](const HttpResult& r) {
      idle_ok += r.status == 200;
      if (++idle_done == kIdle) event_base_loopbreak(base);
    });
  }
  timeval limit{120, 0};
  event_base_loopexit(base, &limit);
  event_base_dispatch(base);
  ASSERT_EQ(idle_ok, kIdle);
  // They stay open (keep-alive): the router holds a socket for each.
  const int files_idle = OpenFiles(pid);
  EXPECT_GE(files_idle, kIdle);
  const int threads_idle = testing::ThreadCount(pid);

  int streams_ok = 0, streams_done = 0, streaming_at_once = 0, max_streaming = 0, threads_max = threads_idle;
  // Long enough that the first streams are still running when the last start,
  // also with other processes on the cores: with 48 tokens, 46 of the 200
  // overlapped in a CI run (two tests at once) and 84 beside a busy loop; with
  // 256, all 200 beside two busy loops, in each of four runs.
  constexpr int kStreamTokens = 256;
  for (int i = 0; i < kStreams; ++i) {
    streams.push_back(std::make_unique<testing::HttpConnection>(base, port_));
    streams.back()->Send(
        "POST", "/v1/completions", StreamBody(i + 1, kStreamTokens), {},
        [&](const HttpResult& r) {
          --streaming_at_once;
          // Every token (ignore_eos: all kTokens of them, so the finish
          // reason is "length"), then [DONE]. Tokens that end inside a UTF-8
          // character carry no text and so no event of their own.
          const bool complete = r.status == 200 && absl::EndsWith(r.body, "data: [DONE]\n\n") &&
                                Count(r.body, "\"finish_reason\":\"length\"") == 1 &&
                                Count(r.body, "data: ") >= 3;
          EXPECT_TRUE(complete) << r.status << " " << r.body.substr(0, 300);
          streams_ok += complete;
          if (++streams_done == kStreams) event_base_loopbreak(base);
        },
        [&](const HttpResult& r) {
          if (r.chunks == 1) max_streaming = std::max(max_streaming, ++streaming_at_once);
          if (r.chunks % 8 == 0) threads_max = std::max(threads_max, testing::ThreadCount(pid));
        });
  }
  limit = {300, 0};
  event_base_loopexit(base, &limit);
  event_base_dispatch(base);
  EXPECT_EQ(streams_ok, kStreams);
  const int files_streams = OpenFiles(pid);
  std::printf(
      "router threads: %d before, %d with %d idle keep-alive connections, at most %d while %d SSE streams "
      "ran "
      "(%d at once had their first token); open files %d -> %d -> %d\n",
      threads_before, threads_idle, kIdle, threads_max, kStreams, max_streaming, files_before, files_idle,
      files_streams);
  EXPECT_GE(max_streaming, kStreams / 2) << "the streams should overlap";
  // An event loop, not a thread per connection: 2,200 connections cost a few
  // threads at most (gRPC's callback pool may grow by some under load).
  EXPECT_LE(threads_idle - threads_before, 2);
  EXPECT_LE(threads_max - threads_before, 16);
  // Idle connections are still there after the streams.
  int again = 0, again_done = 0;
  for (int i = 0; i < kIdle; i += 100) {
    idle[i]->Send("GET", "/ready", "", {}, [&](const HttpResult& r) {
      again += r.status == 200;
      if (++again_done == kIdle / 100) event_base_loopbreak(base);
    });
  }
  limit = {60, 0};
  event_base_loopexit(base, &limit);
  event_base_dispatch(base);
  EXPECT_EQ(again, kIdle / 100);
  idle.clear();
  streams.clear();
  event_base_free(base);
}

// An HTTP/1.0 client that asks for keep-alive and a stream: HTTP/1.0 has no
// chunked encoding, so the stream ends with the connection, which the headers
// say. Before, the reply announced Content-Length: 0 and the events followed
// it on a connection kept open: curl --http1.0 printed nothing.
TEST_F(HttpGatewayTest, AnHttp10StreamEndsWithItsConnection) {
  RawClient client(port_);
  const std::string body = StreamBody(3, 5);
  ASSERT_TRUE(client.Send(absl::StrCat("POST /v1/completions HTTP/1.0\r\nConnection: keep-alive\r\n",
                                       "Content-Type: application/json\r\nContent-Length: ", body.size(),
                                       "\r\n\r\n", body)));
  ASSERT_TRUE(client.ReadToEnd()) << "the connection stayed open after the stream: " << client.received();
  const std::string& got = client.received();
  const std::string head = got.substr(0, got.find("\r\n\r\n"));
  EXPECT_THAT(head, HasSubstr("200"));
  EXPECT_THAT(head, Not(HasSubstr("Content-Length")));
  EXPECT_THAT(head, HasSubstr("Connection: close"));
  EXPECT_EQ(Count(got, "data: {"), 5 + 1) << got;  // five tokens and the usage
  EXPECT_THAT(got, HasSubstr("data: [DONE]"));
}

// Content-Length headers that disagree frame the body two ways: libevent read
// the first, and the rest of the body (here a whole GET) was served as the
// next request on the connection (request smuggling, behind a proxy that read
// the other). Now 400, and the connection closes before anything else is read.
TEST_F(HttpGatewayTest, AnAmbiguousLengthIsRefusedAndEndsTheConnection) {
  for (const char* second : {"Content-Length: 40", "Transfer-Encoding: chunked"}) {
    SCOPED_TRACE(second);
    RawClient client(port_);
    const std::string smuggled = "GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n";
    ASSERT_TRUE(client.Send(absl::StrCat("POST /v1/completions HTTP/1.1\r\nHost: x\r\n",
                                         "Content-Type: application/json\r\nContent-Length: 2\r\n", second,
                                         "\r\n\r\n{}", smuggled)));
    ASSERT_TRUE(client.ReadToEnd()) << "the connection stayed open: " << client.received();
    const std::string& got = client.received();
    EXPECT_THAT(got.substr(0, got.find("\r\n")), HasSubstr("400")) << got;
    EXPECT_EQ(Count(got, "HTTP/1.1 "), 1) << "a second answer on the connection: " << got;
    EXPECT_THAT(got, Not(HasSubstr("\"object\":\"list\""))) << got;
  }
  // Two that agree frame it one way: served.
  RawClient agree(port_);
  const std::string body = R"({"prompt": [5], "max_tokens": 1})";
  ASSERT_TRUE(agree.Send(absl::StrCat("POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n",
                                      "Content-Type: application/json\r\nContent-Length: ", body.size(),
                                      "\r\nContent-Length: ", body.size(), "\r\n\r\n", body)));
  ASSERT_TRUE(agree.ReadToEnd());
  EXPECT_THAT(agree.received().substr(0, agree.received().find("\r\n")), HasSubstr("200"))
      << agree.received();
  // An empty x-session-id names no session: refused, as one with a space is.
  EXPECT_EQ(HttpFetch(port_, "POST", "/v1/completions", R"({"prompt": [5], "max_tokens": 1})",
                      {{"x-session-id", ""}})
                .status,
            400);
}

// The router's kvcache_router_requests_total{code=...}, or -1.
double RequestsWithCode(int metrics_port, const std::string& code) {
  auto body = testing::HttpGet(metrics_port, "/metrics");
  if (!body.ok()) return -1;
  const std::string name = absl::StrCat("kvcache_router_requests_total{code=\"", code, "\"} ");
  const size_t at = body->find(name);
  if (at == std::string::npos) return 0;
  return std::atof(body->c_str() + at + name.size());
}

// What the gateway refuses itself counts in kvcache_router_requests_total as
// the same call over gRPC does (it counted nothing), a context too long says
// so in the code OpenAI's clients look for, and requests OpenAI takes (top_p
// 0) or refuses (a forced tool call) get the same answer here.
TEST_F(HttpGatewayTest, RefusalsAreCountedAndSpeakOpenAi) {
  const int metrics = router_->metrics_port();
  const double unauthenticated = RequestsWithCode(metrics, "UNAUTHENTICATED");
  const double invalid = RequestsWithCode(metrics, "INVALID_ARGUMENT");
  const double not_found = RequestsWithCode(metrics, "NOT_FOUND");
  EXPECT_EQ(HttpFetch(port_, "POST", "/v1/completions", R"({"prompt": [5]})",
                      {{"Authorization", "Bearer not-a-token-of-this-router"}})
                .status,
            401);
  EXPECT_EQ(HttpFetch(port_, "POST", "/v1/completions", R"({"prompt": [5], "temperature": 5})").status, 400);
  HttpResult forced =
      HttpFetch(port_, "POST", "/v1/chat/completions",
                R"({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"})");
  EXPECT_EQ(forced.status, 400) << forced.body;
  EXPECT_EQ(Json::parse(forced.body)["error"]["param"], "tool_choice");
  EXPECT_EQ(HttpFetch(port_, "POST", "/v1/completions", R"({"model": "gpt-4", "prompt": [5]})").status, 404);
  EXPECT_EQ(RequestsWithCode(metrics, "UNAUTHENTICATED"), unauthenticated + 1);
  EXPECT_EQ(RequestsWithCode(metrics, "INVALID_ARGUMENT"), invalid + 2);
  EXPECT_EQ(RequestsWithCode(metrics, "NOT_FOUND"), not_found + 1);

  // top_p 0 keeps the most likely token: the greedy reply, whatever the seed.
  HttpResult greedy =
      HttpFetch(port_, "POST", "/v1/completions",
                R"({"prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0, "ignore_eos": true})");
  ASSERT_EQ(greedy.status, 200) << greedy.body;
  for (const char* top_p : {"0", "5e-324"}) {
    HttpResult cut = HttpFetch(port_, "POST", "/v1/completions",
                               absl::StrCat(R"({"prompt": [5, 6, 7], "max_tokens": 8, "temperature": 1, )",
                                            R"("seed": 11, "ignore_eos": true, "top_p": )", top_p, "}"));
    ASSERT_EQ(cut.status, 200) << top_p << ": " << cut.body;
    EXPECT_EQ(Json::parse(cut.body)["choices"][0]["text"], Json::parse(greedy.body)["choices"][0]["text"])
        << top_p;
  }

  // Over the model's 1,024-token context.
  Json ids = Json::array();
  for (int i = 0; i < 1100; ++i) ids.push_back(100 + i % 200);
  HttpResult too_long = HttpFetch(port_, "POST", "/v1/completions", Json{{"prompt", ids}}.dump());
  EXPECT_EQ(too_long.status, 400) << too_long.body;
  EXPECT_EQ(Json::parse(too_long.body)["error"]["code"], "context_length_exceeded") << too_long.body;
}

}  // namespace
}  // namespace kvcache
