// router.json: what the router costs.
//
//  router_added_ttft_p50_ms   p50 time to first token through the router minus
//                             p50 straight to the worker (same requests, loopback)
//  router_vs_direct_tokens    decode tokens/s streamed through the router ÷
//                             straight from the worker
//  router_added_p99_ms_256_streams
//                             with 256 streams open at once: p99 of each call's
//                             path time (client-observed time to first token
//                             minus the worker's own, so the worker's queue,
//                             full at that load, is left out) through the
//                             router, minus the same p99 straight to the worker
//                             (alternating rounds in the same run)
//  http_added_ttft_p50_ms     p50 time to first token through the router's
//                             OpenAI HTTP API (a streaming /v1/completions on
//                             a keep-alive connection, first SSE event) minus
//                             p50 through its gRPC API (same requests,
//                             alternating)
//  http_added_path_ms_p50     the same minus the worker's own time to first
//                             token (gRPC: usage; HTTP: the "kvcache" field of
//                             the usage chunk): the HTTP path alone
//  decisions_per_second       placement decisions (hash a 512-token prompt's
//                             pages, match them in a directory of 10,000
//                             sessions on 8 workers, score, choose) per second,
//                             in-process
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "common/bench_json.h"
#include "common/block_hash.h"
#include "common/gguf/model_path.h"
#include "event2/event.h"
#include "kvcache/v1/router.grpc.pb.h"
#include "kvcache/v1/worker.grpc.pb.h"
#include "router/directory.h"
#include "router/placement.h"
#include "tests/testing/child_process.h"
#include "tests/testing/http_client.h"

ABSL_FLAG(int, requests, 40, "Requests per path for the time-to-first-token comparison");
ABSL_FLAG(int, decode_tokens, 200, "Tokens generated for the throughput comparison");
ABSL_FLAG(int, threads, 2, "Worker compute threads");
ABSL_FLAG(int, concurrent_streams, 256, "Streams open at once for the concurrent-latency comparison");
ABSL_FLAG(int, concurrent_calls, 256, "Calls per path per round of the concurrent-latency comparison");
ABSL_FLAG(int, concurrent_rounds, 2, "Rounds per path (alternating direct / router) of that comparison");

namespace kvcache {
namespace {

double Percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[std::min(v.size() - 1, static_cast<size_t>(p * v.size()))];
}

struct Timing {
  double ttft_ms = 0;
  double worker_ttft_ms = 0;  // as the worker measured it (usage)
  double tokens_per_s = 0;
  bool ok = false;
};

// A prompt of exactly `n` ordinary token ids, different for each `seed`, so that
// both paths prefill the same amount of work.
std::vector<int32_t> Prompt(int seed, int n) {
  std::vector<int32_t> ids;
  for (int i = 0; i < n; ++i) ids.push_back(1000 + (seed * 7919 + i * 131) % 30000);
  return ids;
}

template <typename Stub>
Timing Measure(Stub* stub, const std::vector<int32_t>& prompt, int max_tokens) {
  v1::GenerateRequest req;
  req.mutable_input()->mutable_tokens()->mutable_ids()->Assign(prompt.begin(), prompt.end());
  req.mutable_sampling()->set_max_tokens(max_tokens);
  req.mutable_sampling()->set_ignore_eos(true);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::minutes(5));
  const absl::Time start = absl::Now();
  auto reader = stub->Generate(&ctx, req);
  v1::GenerateResponse msg;
  double t_worker_ms = 0;
  int n = 0;
  absl::Time first, last;
  while (reader->Read(&msg)) {
    if (msg.has_final()) t_worker_ms = msg.final().usage().time_to_first_token_us() / 1e3;
    if (!msg.has_token()) continue;
    last = absl::Now();
    if (n++ == 0) first = last;
  }
  Timing t;
  t.ok = reader->Finish().ok() && n > 0;
  t.ttft_ms = absl::ToDoubleMilliseconds(first - start);
  t.worker_ttft_ms = t_worker_ms;
  t.tokens_per_s = n > 1 ? (n - 1) / absl::ToDoubleSeconds(last - first) : 0;
  return t;
}

// The same single-token request through the router's HTTP API, on a
// keep-alive connection: ms from sending it to the first SSE event (the
// status line and the first token leave the router together).
// `worker_ttft_ms` is the worker's own measure, from the usage chunk.
double MeasureHttp(event_base* base, testing::HttpConnection* conn, const std::vector<int32_t>& prompt,
                   double* worker_ttft_ms) {
  const std::string body = absl::StrCat("{\"prompt\": [", absl::StrJoin(prompt, ","),
                                        "], \"max_tokens\": 1, \"temperature\": 0, \"ignore_eos\": true, "
                                        "\"stream\": true, \"stream_options\": {\"include_usage\": true}}");
  testing::HttpResult result;
  conn->Send("POST", "/v1/completions", body, {}, [&](const testing::HttpResult& r) {
    result = r;
    event_base_loopbreak(base);
  });
  event_base_dispatch(base);
  constexpr char kField[] = "\"time_to_first_token_ms\":";
  const size_t at = result.body.find(kField);
  if (result.status != 200 || result.body.find("data: [DONE]") == std::string::npos ||
      at == std::string::npos)
    return -1;
  *worker_ttft_ms = std::strtod(result.body.c_str() + at + sizeof(kField) - 1, nullptr);
  return absl::ToDoubleMilliseconds(result.first_chunk - result.sent);
}

// What one call of a concurrent run took, in ms.
struct CallTimes {
  double latency_ms = 0;  // call start to end of stream
  double path_ms = 0;     // client-observed time to first token minus the worker's own
};

// Keeps `streams` Generate calls open at once on `stub` (a Worker or a KvCache
// stub) until `calls` have been made, through gRPC's callback API so that the
// client needs no thread per stream. Returns each call's times, or nothing when
// any call failed.
template <typename Stub>
std::vector<CallTimes> ConcurrentCalls(Stub* stub, int streams, int calls, int seed_base, int prompt_tokens,
                                       int max_tokens) {
  struct Run {
    absl::Mutex mu;
    int started ABSL_GUARDED_BY(mu) = 0;
    int finished ABSL_GUARDED_BY(mu) = 0;
    bool failed ABSL_GUARDED_BY(mu) = false;
    std::vector<CallTimes> times ABSL_GUARDED_BY(mu);
  } run;
  class Call : public grpc::ClientReadReactor<v1::GenerateResponse> {
   public:
    Call(Stub* stub, Run* run, int calls, int seed_base, int prompt_tokens, int max_tokens)
        : stub_(stub),
          run_(run),
          calls_(calls),
          seed_base_(seed_base),
          prompt_tokens_(prompt_tokens),
          max_tokens_(max_tokens) {}
    // Starts the next call of the run, if one is left; false otherwise.
    bool StartNext() {
      int seed;
      {
        absl::MutexLock lock(&run_->mu);
        if (run_->started == calls_) return false;
        seed = seed_base_ + run_->started++;
      }
      ctx_ = std::make_unique<grpc::ClientContext>();
      ctx_->set_deadline(std::chrono::system_clock::now() + std::chrono::minutes(5));
      const std::vector<int32_t> prompt = Prompt(seed, prompt_tokens_);
      req_.Clear();
      req_.mutable_input()->mutable_tokens()->mutable_ids()->Assign(prompt.begin(), prompt.end());
      req_.mutable_sampling()->set_max_tokens(max_tokens_);
      req_.mutable_sampling()->set_ignore_eos(true);
      tokens_ = 0;
      start_ = absl::Now();
      stub_->async()->Generate(ctx_.get(), &req_, this);
      StartRead(&msg_);
      StartCall();
      return true;
    }
    void OnReadDone(bool ok) override {
      if (!ok) return;
      if (msg_.has_token() && tokens_++ == 0) first_ = absl::Now();
      if (msg_.has_final()) worker_ttft_ms_ = msg_.final().usage().time_to_first_token_us() / 1e3;
      StartRead(&msg_);
    }
    void OnDone(const grpc::Status& st) override {
      CallTimes t;
      t.latency_ms = absl::ToDoubleMilliseconds(absl::Now() - start_);
      t.path_ms = absl::ToDoubleMilliseconds(first_ - start_) - worker_ttft_ms_;
      // A reactor serves one call: this stream's next call is a fresh reactor,
      // started before this one counts as finished, so that the waiter cannot
      // return (and `run_` go away) while it still starts.
      auto* next = new Call(stub_, run_, calls_, seed_base_, prompt_tokens_, max_tokens_);
      if (!next->StartNext()) delete next;
      {
        absl::MutexLock lock(&run_->mu);  // the last use of run_
        if (!st.ok() || tokens_ != max_tokens_) {
          if (!run_->failed) std::fprintf(stderr, "call failed: %s\n", st.error_message().c_str());
          run_->failed = true;
        }
        run_->times.push_back(t);
        ++run_->finished;
      }
      delete this;
    }

   private:
    Stub* const stub_;
    Run* const run_;
    const int calls_, seed_base_, prompt_tokens_, max_tokens_;
    std::unique_ptr<grpc::ClientContext> ctx_;
    v1::GenerateRequest req_;
    v1::GenerateResponse msg_;
    int tokens_ = 0;
    double worker_ttft_ms_ = 0;
    absl::Time start_, first_;
  };
  for (int i = 0; i < streams; ++i) {
    auto* c = new Call(stub, &run, calls, seed_base, prompt_tokens, max_tokens);
    if (!c->StartNext()) delete c;
  }
  absl::MutexLock lock(&run.mu);
  auto all_done = [&run, calls]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(run.mu) { return run.finished == calls; };
  run.mu.Await(absl::Condition(&all_done));
  if (run.failed) return {};
  return run.times;
}

double DecisionsPerSecond() {
  using router::Candidate;
  using router::Directory;
  Directory dir;
  const int workers = 8, sessions = 10000, page_tokens = 16;
  std::mt19937 rng(1);
  // Each worker holds sessions with distinct 512-token prompts, plus a shared
  // system prompt of 256 tokens cached everywhere.
  std::vector<int32_t> system(256);
  for (auto& t : system) t = static_cast<int32_t>(rng() % 49152);
  std::vector<std::vector<int32_t>> prompts;
  for (int s = 0; s < sessions; ++s) {
    std::vector<int32_t> p = system;
    for (int i = 0; i < 256; ++i) p.push_back(static_cast<int32_t>(rng() % 49152));
    const std::string w = absl::StrCat("worker-", s % workers);
    v1::CacheEvent placed;
    placed.set_kind(v1::CacheEvent::SESSION_PLACED);
    placed.set_session_id(absl::StrCat("s", s));
    placed.set_tokens(static_cast<int32_t>(p.size()));
    dir.ApplyEvent(w, placed);
    v1::CacheEvent stored;
    stored.set_kind(v1::CacheEvent::PREFIX_STORED);
    stored.set_tier(v1::TIER_DEVICE);
    for (const BlockHash& h : ChainBlockHashes(p, page_tokens, "model", "tenant")) {
      stored.add_block_hashes(std::string(h.bytes.begin(), h.bytes.end()));
    }
    dir.ApplyEvent(w, stored);
    if (s < 1000) prompts.push_back(std::move(p));
  }
  router::PlacementConfig config;
  const absl::Time start = absl::Now();
  int decisions = 0;
  size_t sink = 0;
  while (absl::Now() - start < absl::Seconds(2)) {
    const auto& p = prompts[decisions % prompts.size()];
    const auto chain = ChainBlockHashes(p, page_tokens, "model", "tenant");
    const auto matches = dir.MatchPrefix(chain);
    const auto session_counts = dir.SessionCounts();
    std::vector<Candidate> cands;
    for (int w = 0; w < workers; ++w) {
      Candidate c;
      c.worker = absl::StrCat("worker-", w);
      c.load.set_pages_total_device(1000);
      c.load.set_pages_free_device(500);
      auto m = matches.find(c.worker);
      if (m != matches.end()) c.match = m->second;
      if (auto n = session_counts.find(c.worker); n != session_counts.end()) c.sessions = n->second;
      cands.push_back(std::move(c));
    }
    auto placed = router::Choose(config, absl::StrCat("new-", decisions), "", page_tokens,
                                 static_cast<int>(p.size() / page_tokens), /*new_session=*/true, cands,
                                 /*retry=*/false);
    sink += placed.ok() ? placed->worker.size() : 0;
    ++decisions;
  }
  if (sink == 0) std::fprintf(stderr, "no placement succeeded\n");
  return decisions / absl::ToDoubleSeconds(absl::Now() - start);
}

int Run() {
  bench::BenchReport report;
  report.benchmark = "router";
  auto worker = testing::ServerUnderTest::Start(
      testing::BinaryPath("worker/kvcache-worker"),
      {"--worker_id=w", "--threads=" + std::to_string(absl::GetFlag(FLAGS_threads)),
       "--model=" + gguf::DefaultModelPath()});
  if (!worker.ok()) {
    std::fprintf(stderr, "worker: %s\n", worker.status().ToString().c_str());
    return 1;
  }
  auto router = testing::ServerUnderTest::Start(
      testing::BinaryPath("router/kvcache-router"),
      {"--workers=" + (*worker)->grpc_address(), "--model=" + gguf::DefaultModelPath(),
       "--rebalance_interval=0s", "--http_listen=127.0.0.1:0"});
  if (!router.ok()) {
    std::fprintf(stderr, "router: %s\n", router.status().ToString().c_str());
    return 1;
  }
  auto direct = v1::Worker::NewStub((*worker)->channel());
  auto routed = v1::KvCache::NewStub((*router)->channel());
  std::vector<double> ttft_direct, ttft_routed, tps_direct, tps_routed, worker_direct, worker_routed;
  const int n = absl::GetFlag(FLAGS_requests);
  for (int i = 0; i < n; ++i) {
    // Alternate the paths so that drift on a shared machine hits both alike;
    // distinct prompts of equal length so that neither path gets a cache hit.
    Timing d = Measure(direct.get(), Prompt(2 * i, 24), 1);
    Timing r = Measure(routed.get(), Prompt(2 * i + 1, 24), 1);
    if (!d.ok || !r.ok) return 1;
    ttft_direct.push_back(d.ttft_ms);
    ttft_routed.push_back(r.ttft_ms);
    worker_direct.push_back(d.worker_ttft_ms);
    worker_routed.push_back(r.worker_ttft_ms);
  }
  for (int i = 0; i < 3; ++i) {
    Timing d = Measure(direct.get(), Prompt(1000 + 2 * i, 16), absl::GetFlag(FLAGS_decode_tokens));
    Timing r = Measure(routed.get(), Prompt(1001 + 2 * i, 16), absl::GetFlag(FLAGS_decode_tokens));
    if (!d.ok || !r.ok) return 1;
    tps_direct.push_back(d.tokens_per_s);
    tps_routed.push_back(r.tokens_per_s);
  }
  report.metrics["ttft_p50_ms_router"] = Percentile(ttft_routed, 0.5);
  report.baseline["ttft_p50_ms_direct"] = Percentile(ttft_direct, 0.5);
  report.metrics["router_added_ttft_p50_ms"] = Percentile(ttft_routed, 0.5) - Percentile(ttft_direct, 0.5);
  // The worker's own measure of the same requests: what the router adds is the
  // client-side difference minus any difference here.
  report.metrics["worker_side_ttft_p50_ms_router"] = Percentile(worker_routed, 0.5);
  report.baseline["worker_side_ttft_p50_ms_direct"] = Percentile(worker_direct, 0.5);
  // The path alone: client-observed minus worker-observed time to first token,
  // routed vs direct (excludes the worker computing more slowly while the router
  // process shares its cores).
  std::vector<double> path_direct, path_routed;
  for (size_t i = 0; i < ttft_direct.size(); ++i) {
    path_direct.push_back(ttft_direct[i] - worker_direct[i]);
    path_routed.push_back(ttft_routed[i] - worker_routed[i]);
  }
  report.metrics["router_added_path_ms_p50"] = Percentile(path_routed, 0.5) - Percentile(path_direct, 0.5);
  // HTTP against gRPC, both through the router, alternating.
  int http_port = 0;
  {
    const std::string& out = (*router)->process().output();
    const size_t at = out.find(" http=");
    const size_t colon = at == std::string::npos ? at : out.find(':', at);
    if (colon == std::string::npos ||
        !absl::SimpleAtoi(out.substr(colon + 1, out.find_first_of(" \n", colon) - colon - 1), &http_port)) {
      std::fprintf(stderr, "no http= on the router's listening line: %s\n", out.c_str());
      return 1;
    }
  }
  event_base* base = event_base_new();
  std::vector<double> ttft_grpc, ttft_http, path_grpc, path_http;
  {
    testing::HttpConnection conn(base, http_port);
    for (int i = 0; i < n; ++i) {
      Timing g = Measure(routed.get(), Prompt(5000 + 2 * i, 24), 1);
      double worker_ms = 0;
      const double h = MeasureHttp(base, &conn, Prompt(5001 + 2 * i, 24), &worker_ms);
      if (!g.ok || h < 0) return 1;
      ttft_grpc.push_back(g.ttft_ms);
      ttft_http.push_back(h);
      path_grpc.push_back(g.ttft_ms - g.worker_ttft_ms);
      path_http.push_back(h - worker_ms);
    }
  }
  event_base_free(base);
  report.metrics["ttft_p50_ms_http"] = Percentile(ttft_http, 0.5);
  report.baseline["ttft_p50_ms_grpc_router"] = Percentile(ttft_grpc, 0.5);
  report.metrics["http_added_ttft_p50_ms"] = Percentile(ttft_http, 0.5) - Percentile(ttft_grpc, 0.5);
  report.metrics["http_path_ms_p50"] = Percentile(path_http, 0.5);
  report.baseline["grpc_router_path_ms_p50"] = Percentile(path_grpc, 0.5);
  report.metrics["http_added_path_ms_p50"] = Percentile(path_http, 0.5) - Percentile(path_grpc, 0.5);

  report.metrics["router_tokens_per_s"] = Percentile(tps_routed, 0.5);
  report.baseline["direct_tokens_per_s"] = Percentile(tps_direct, 0.5);
  report.ratio["router_vs_direct_tokens"] = Percentile(tps_routed, 0.5) / Percentile(tps_direct, 0.5);

  // Many streams at once: what the router adds to the tail. At this load the
  // worker's queue (its --max_running) dominates a call's latency in both paths
  // and varies from run to run, so the figure is the path time, which leaves
  // it out; the latencies themselves are reported beside it. Rounds alternate
  // the paths; distinct prompts so that no call gets a cache hit.
  const int streams = absl::GetFlag(FLAGS_concurrent_streams), calls = absl::GetFlag(FLAGS_concurrent_calls);
  std::vector<double> lat_direct, lat_routed, cpath_direct, cpath_routed;
  for (int round = 0; round < absl::GetFlag(FLAGS_concurrent_rounds); ++round) {
    const int seed = 100000 + 2 * round * calls;
    auto d = ConcurrentCalls(direct.get(), streams, calls, seed, 16, 4);
    auto r = ConcurrentCalls(routed.get(), streams, calls, seed + calls, 16, 4);
    if (d.empty() || r.empty()) return 1;
    for (const CallTimes& t : d) {
      lat_direct.push_back(t.latency_ms);
      cpath_direct.push_back(t.path_ms);
    }
    for (const CallTimes& t : r) {
      lat_routed.push_back(t.latency_ms);
      cpath_routed.push_back(t.path_ms);
    }
  }
  report.metrics["path_p99_ms_256_streams_router"] = Percentile(cpath_routed, 0.99);
  report.baseline["path_p99_ms_256_streams_direct"] = Percentile(cpath_direct, 0.99);
  report.metrics["router_added_p99_ms_256_streams"] =
      Percentile(cpath_routed, 0.99) - Percentile(cpath_direct, 0.99);
  report.metrics["latency_p99_ms_256_streams_router"] = Percentile(lat_routed, 0.99);
  report.baseline["latency_p99_ms_256_streams_direct"] = Percentile(lat_direct, 0.99);
  report.metrics["decisions_per_second"] = DecisionsPerSecond();
  report.notes["method"] = absl::StrCat(
      "one SmolLM2 worker and one router on loopback; ", n,
      " single-token requests of 24-token prompts per path alternating direct/router (TTFT p50), and as many "
      "alternating router gRPC/HTTP (streaming /v1/completions on a keep-alive connection: first SSE event), "
      "3 x ",
      absl::GetFlag(FLAGS_decode_tokens), "-token streams per path (median tokens/s); ",
      absl::GetFlag(FLAGS_concurrent_rounds), " rounds x ", calls,
      " calls per path of 16-token prompts and 4 tokens with ", streams,
      " streams open at once (callback client), alternating direct/router (p99 of client-observed minus "
      "worker-reported time to first token; and p99 latency); decisions: "
      "SHA-256 chain of a 512-token prompt + directory match (10,000 sessions, 8 workers) + scoring, "
      "in-process, 2 s");
  return bench::Finish(report).ok() ? 0 : 1;
}

}  // namespace
}  // namespace kvcache

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return kvcache::Run();
}
