// router.json: what the router costs.
//
//  router_added_ttft_p50_ms   p50 time to first token through the router minus
//                             p50 straight to the worker (same requests, loopback)
//  router_vs_direct_tokens    decode tokens/s streamed through the router ÷
//                             straight from the worker
//  decisions_per_second       placement decisions (hash a 512-token prompt's
//                             pages, match them in a directory of 10,000
//                             sessions on 8 workers, score, choose) per second,
//                             in-process
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "common/bench_json.h"
#include "common/block_hash.h"
#include "common/gguf/model_path.h"
#include "kvcache/v1/router.grpc.pb.h"
#include "kvcache/v1/worker.grpc.pb.h"
#include "router/directory.h"
#include "router/placement.h"
#include "tests/testing/child_process.h"
#include "worker/backend/cpu/omp_env.h"

ABSL_FLAG(int, requests, 40, "Requests per path for the time-to-first-token comparison");
ABSL_FLAG(int, decode_tokens, 200, "Tokens generated for the throughput comparison");
ABSL_FLAG(int, threads, 2, "Worker compute threads");

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
                                 static_cast<int>(p.size() / page_tokens), cands, false);
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
  auto router =
      testing::ServerUnderTest::Start(testing::BinaryPath("router/kvcache-router"),
                                      {"--workers=" + (*worker)->grpc_address(),
                                       "--model=" + gguf::DefaultModelPath(), "--rebalance_interval=0s"});
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
  report.metrics["router_tokens_per_s"] = Percentile(tps_routed, 0.5);
  report.baseline["direct_tokens_per_s"] = Percentile(tps_direct, 0.5);
  report.ratio["router_vs_direct_tokens"] = Percentile(tps_routed, 0.5) / Percentile(tps_direct, 0.5);
  report.metrics["decisions_per_second"] = DecisionsPerSecond();
  report.notes["method"] = absl::StrCat(
      "one SmolLM2 worker and one router on loopback; ", n,
      " single-token requests of 24-token prompts per path alternating direct/router (TTFT p50), 3 x ",
      absl::GetFlag(FLAGS_decode_tokens),
      "-token streams per path (median tokens/s); decisions: "
      "SHA-256 chain of a 512-token prompt + directory match (10,000 sessions, 8 workers) + scoring, "
      "in-process, 2 s");
  return bench::Finish(report).ok() ? 0 : 1;
}

}  // namespace
}  // namespace kvcache

int main(int argc, char** argv) {
  kvcache::cpu::EnsureOmpWaitSettings(argv);
  absl::ParseCommandLine(argc, argv);
  return kvcache::Run();
}
