// worker.json: the worker over real gRPC on loopback, with SmolLM2.
//
//  ttft_cold_vs_cached       time to first token of a turn after a ~2,000-token
//                            history with nothing cached (a fresh tenant) ÷ the
//                            same turn when the history is cached (APPEND)
//  grpc_vs_inprocess_tokens  decode tokens/s streamed through gRPC ÷ tokens/s of
//                            the same engine driven in-process (same model,
//                            threads and request)
//  migration_total_ms, migration_pause_ms: moving a 4,000-token session between
//                            two worker processes (pause = the final phase,
//                            when the session cannot decode)
//  rss_growth_after_churn    resident memory of the worker and of a router
//                            watching it after --churn_rounds rounds of opening
//                            and closing --churn_sessions sessions, divided by
//                            after the first round (the larger of the two; both
//                            are in metrics)
//  shared_prefix_burst_prefill_vs_ideal
//                            --burst_sessions new conversations sharing one
//                            --burst_system_tokens system prompt, arriving
//                            evenly within one second: prompt tokens the worker
//                            computed (kvcache_prefill_tokens_total) ÷ one system
//                            prompt plus every private part
//  burst_two_workers_vs_one  32 concurrent new sessions sharing a system prompt
//                            one worker has cached, through a router: time for
//                            all to finish on one worker ÷ on two (1 thread each)
//  tenant_quiet_vs_flood_ttft
//                            one tenant sends --flood_requests concurrent
//                            requests to a worker; another tenant sends three,
//                            0.5, 1.5 and 2.5 s later: the quiet
//                            tenant's time to first token (median) ÷ the
//                            flooding tenant's (median), twice: with the
//                            worker's slots full (--max_running=8, the flood
//                            queues: `_admission`) and with every request
//                            running (prompts compete for prefill: `_prefill`)
// Each figure is the median of --reps runs, taken in this one run (the burst and
// tenant figures: one run each). --sections picks the parts to run.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "common/bench_json.h"
#include "common/gguf/model_path.h"
#include "common/tokenizer/tokenizer.h"
#include "kvcache/v1/router.grpc.pb.h"
#include "kvcache/v1/worker.grpc.pb.h"
#include "tests/testing/child_process.h"
#include "worker/backend/cpu/cpu_llama_runner.h"
#include "worker/sched/engine.h"

ABSL_FLAG(int, threads, 2, "Compute threads of the workers and the in-process engine");
ABSL_FLAG(int, reps, 3, "Repetitions per figure (median kept)");
ABSL_FLAG(int, history_tokens, 2000, "History length for the time-to-first-token comparison");
ABSL_FLAG(int, migrate_tokens, 4000, "Length of the migrated session");
ABSL_FLAG(int, decode_tokens, 256, "Tokens generated for the streaming comparison");
ABSL_FLAG(int, churn_sessions, 10000, "Sessions opened and closed per churn round");
ABSL_FLAG(int, churn_rounds, 10, "Churn rounds");
ABSL_FLAG(int, burst_sessions, 16, "New conversations in the shared-prefix burst");
ABSL_FLAG(int, burst_system_tokens, 1500, "Shared system prompt of the shared-prefix burst");
ABSL_FLAG(int, burst_private_tokens, 100, "Private part of each burst conversation");
ABSL_FLAG(int, flood_requests, 32, "Concurrent requests of the flooding tenant in the tenant section");
ABSL_FLAG(std::string, sections, "ttft,streaming,migration,churn,burst,router_burst,tenants",
          "Parts to run, comma-separated");

namespace kvcache {
namespace {

using bench::Median;

// A synthetic history of exactly n token ids (ordinary vocabulary, no control
// tokens), so that lengths are exact.
std::vector<int32_t> History(int n, int salt) {
  std::vector<int32_t> t;
  for (int i = 0; i < n; ++i) t.push_back(1000 + (i * 37 + salt * 101) % 20000);
  return t;
}

v1::GenerateRequest TokensRequest(const std::string& session, const std::string& tenant,
                                  const std::vector<int32_t>& tokens, int max_tokens, v1::Mode mode) {
  v1::GenerateRequest r;
  r.set_session_id(session);
  r.set_tenant(tenant);
  r.set_mode(mode);
  r.mutable_input()->mutable_tokens()->mutable_ids()->Assign(tokens.begin(), tokens.end());
  r.mutable_sampling()->set_max_tokens(max_tokens);
  r.mutable_sampling()->set_ignore_eos(true);
  return r;
}

struct Result {
  v1::GenerateResponse::Final final;
  double first_token_s = 0, end_s = 0;
  int tokens = 0;
  grpc::Status status;
};

template <typename Stub>  // a worker's or a router's
Result Call(Stub* stub, const v1::GenerateRequest& req) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::minutes(10));
  const absl::Time start = absl::Now();
  auto reader = stub->Generate(&ctx, req);
  Result r;
  v1::GenerateResponse msg;
  while (reader->Read(&msg)) {
    if (msg.has_token()) {
      if (r.tokens++ == 0) r.first_token_s = absl::ToDoubleSeconds(absl::Now() - start);
    } else {
      r.final = msg.final();
    }
  }
  r.end_s = absl::ToDoubleSeconds(absl::Now() - start);
  r.status = reader->Finish();
  return r;
}

class Collector : public sched::GenerateObserver {
 public:
  void OnToken(int32_t, absl::string_view) override {
    if (tokens++ == 0) first = absl::Now();
    last = absl::Now();
  }
  void OnDone(const absl::Status& s, const sched::GenerateResult&) override {
    status = s;
    done.Notify();
  }
  int tokens = 0;
  absl::Time first, last;
  absl::Status status;
  absl::Notification done;
};

// Decode tokens/s of the engine in this process (no gRPC), same settings.
absl::StatusOr<double> InProcessDecode(int threads, int n_tokens, const std::vector<int32_t>& prompt) {
  auto model = model::LlamaModel::Load(gguf::DefaultModelPath());
  if (!model.ok()) return model.status();
  const auto& hp = (*model)->hparams();
  kv::KvCacheOptions ko;
  ko.shape = kv::KvShape{static_cast<int>(hp.n_layer),
                         static_cast<int>(hp.n_head_kv),
                         static_cast<int>(hp.head_dim),
                         kv::KvDtype::kF16,
                         16,
                         0};
  ko.model_id = (*model)->model_id();
  ko.tier0_bytes = int64_t{1} << 30;
  auto kv = kv::KvCacheManager::Create(ko);
  if (!kv.ok()) return kv.status();
  auto runner = cpu::CpuLlamaRunner::Create(model->get(), kv->get(), {256, threads});
  if (!runner.ok()) return runner.status();
  auto tokenizer = tok::Tokenizer::FromGguf((*model)->file());
  if (!tokenizer.ok()) return tokenizer.status();
  auto engine = sched::Engine::Create({}, runner->get(), kv->get(), tokenizer->get());
  if (!engine.ok()) return engine.status();
  std::vector<double> rates;
  for (int rep = 0; rep < absl::GetFlag(FLAGS_reps); ++rep) {
    Collector c;
    sched::GenerateRequest req;
    req.input = prompt;
    req.tenant = "bench";
    req.max_tokens = n_tokens;
    req.ignore_eos = true;
    auto id = (*engine)->Submit(req, &c);
    if (!id.ok()) return id.status();
    c.done.WaitForNotification();
    if (!c.status.ok()) return c.status;
    rates.push_back((c.tokens - 1) / absl::ToDoubleSeconds(c.last - c.first));
  }
  return Median(rates);
}

// The value of an unlabelled Prometheus sample `name` on the metrics port.
absl::StatusOr<double> MetricValue(int port, const std::string& name) {
  auto body = testing::HttpGet(port, "/metrics");
  if (!body.ok()) return body.status();
  const std::string prefix = "\n" + name + " ";
  const size_t at = body->find(prefix);
  if (at == std::string::npos) return absl::NotFoundError(name + " not exported");
  return std::strtod(body->c_str() + at + prefix.size(), nullptr);
}

// Sends `requests` through `stub`, request i at start + i * spacing, each on its
// own thread; returns the results in order.
template <typename Stub>
std::vector<Result> Burst(Stub* stub, const std::vector<v1::GenerateRequest>& requests,
                          absl::Duration spacing) {
  std::vector<Result> out(requests.size());
  std::vector<std::thread> threads;
  const absl::Time start = absl::Now();
  for (size_t i = 0; i < requests.size(); ++i) {
    threads.emplace_back([&, i] {
      absl::SleepFor(start + spacing * static_cast<double>(i) - absl::Now());  // arrival pacing
      out[i] = Call(stub, requests[i]);
    });
  }
  for (std::thread& t : threads) t.join();
  return out;
}

// 5. New conversations sharing a long system prompt, arriving within a second.
bool SharedPrefixBurst(v1::Worker::Stub* stub, int metrics_port, bench::BenchReport& report) {
  const int n = absl::GetFlag(FLAGS_burst_sessions);
  const int sys = absl::GetFlag(FLAGS_burst_system_tokens);
  const int priv = absl::GetFlag(FLAGS_burst_private_tokens);
  const std::vector<int32_t> system = History(sys, 777);
  std::vector<v1::GenerateRequest> requests;
  for (int i = 0; i < n; ++i) {
    std::vector<int32_t> prompt = system;
    for (int32_t t : History(priv, 900 + i)) prompt.push_back(t);
    requests.push_back(TokensRequest(absl::StrCat("burst-", i), "burst", prompt, 16, v1::FULL_CONTEXT));
  }
  auto before = MetricValue(metrics_port, "kvcache_prefill_tokens_total");
  const absl::Time start = absl::Now();
  std::vector<Result> results = Burst(stub, requests, absl::Seconds(1) / n);
  const double total_s = absl::ToDoubleSeconds(absl::Now() - start);
  auto after = MetricValue(metrics_port, "kvcache_prefill_tokens_total");
  if (!before.ok() || !after.ok()) {
    std::fprintf(stderr, "prefill counter: %s\n", (before.ok() ? after : before).status().ToString().c_str());
    return false;
  }
  std::vector<double> ttft;
  for (const Result& r : results) {
    if (!r.status.ok()) {
      std::fprintf(stderr, "burst request failed: %s\n", r.status.error_message().c_str());
      return false;
    }
    ttft.push_back(r.final.usage().time_to_first_token_us() / 1e3);
  }
  const double ideal = sys + static_cast<double>(n) * priv;
  report.metrics["shared_prefix_burst_prefill_tokens"] = *after - *before;
  report.baseline["shared_prefix_burst_ideal_prefill_tokens"] = ideal;
  report.ratio["shared_prefix_burst_prefill_vs_ideal"] = (*after - *before) / ideal;
  report.metrics["shared_prefix_burst_ttft_p50_ms"] = Median(ttft);
  report.metrics["shared_prefix_burst_ttft_max_ms"] = *std::max_element(ttft.begin(), ttft.end());
  report.metrics["shared_prefix_burst_seconds"] = total_s;
  report.notes["shared_prefix_burst"] = absl::StrCat(
      n, " new sessions of a ", sys, "-token shared system prompt plus ", priv,
      " private tokens (16 generated), arriving evenly within 1 s; prefill tokens from the worker's "
      "kvcache_prefill_tokens_total; ideal = one system prompt + every private part");
  return true;
}

// 6. 32 concurrent new sessions sharing a system prompt one worker has cached,
// through a router over `workers` workers of one thread each. Returns the
// seconds until all finished and how many went to each worker.
absl::StatusOr<double> RouterBurst(int workers, std::map<std::string, int>* per_worker) {
  std::vector<std::unique_ptr<testing::ServerUnderTest>> ws;
  std::string list;
  for (int i = 0; i < workers; ++i) {
    auto w = testing::ServerUnderTest::Start(
        testing::BinaryPath("worker/kvcache-worker"),
        {absl::StrCat("--worker_id=burst-", i), "--threads=1", "--tier0_bytes=1073741824",
         "--load_report_interval=200ms", "--model=" + gguf::DefaultModelPath()});
    if (!w.ok()) return w.status();
    list += (list.empty() ? "" : ",") + (*w)->grpc_address();
    ws.push_back(std::move(*w));
  }
  auto router = testing::ServerUnderTest::Start(
      testing::BinaryPath("router/kvcache-router"),
      {"--workers=" + list, "--model=" + gguf::DefaultModelPath(), "--rebalance_interval=0s",
       absl::StrCat("--min_ready_workers=", workers)});
  if (!router.ok()) return router.status();
  auto stub = v1::KvCache::NewStub((*router)->channel());
  const std::vector<int32_t> system = History(500, 555);
  Result seed = Call(stub.get(), TokensRequest("seed", "", system, 1, v1::FULL_CONTEXT));
  if (!seed.status.ok()) return absl::InternalError(seed.status.error_message());
  std::vector<v1::GenerateRequest> requests;
  for (int i = 0; i < 32; ++i) {
    std::vector<int32_t> prompt = system;
    for (int32_t t : History(100, 300 + i)) prompt.push_back(t);
    requests.push_back(TokensRequest(absl::StrCat("user-", i), "", prompt, 16, v1::FULL_CONTEXT));
  }
  const absl::Time start = absl::Now();
  std::vector<Result> results = Burst(stub.get(), requests, absl::ZeroDuration());
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  for (const Result& r : results) {
    if (!r.status.ok()) return absl::InternalError(r.status.error_message());
    ++(*per_worker)[r.final.worker_id()];
  }
  return seconds;
}

// 7. Two tenants on one worker: "flood" sends --flood_requests concurrent
// requests of `flood_prompt` tokens (`flood_max` generated); from half a second on,
// "quiet" sends three requests of `quiet_prompt` tokens, a second apart.
// Records both tenants' time to first token under `name`.
bool TenantFairness(const std::string& name, const std::vector<std::string>& worker_flags, int flood_prompt,
                    int flood_max, int quiet_prompt, bench::BenchReport& report) {
  std::vector<std::string> flags = worker_flags;
  flags.push_back("--model=" + gguf::DefaultModelPath());
  flags.push_back(absl::StrCat("--threads=", absl::GetFlag(FLAGS_threads)));
  flags.push_back("--tier0_bytes=1073741824");
  auto w = testing::ServerUnderTest::Start(testing::BinaryPath("worker/kvcache-worker"), flags);
  if (!w.ok()) {
    std::fprintf(stderr, "cannot start the worker: %s\n", w.status().ToString().c_str());
    return false;
  }
  auto stub = v1::Worker::NewStub((*w)->channel());
  if (!Call(stub.get(), TokensRequest("", "warm", History(16, 1), 2, v1::FULL_CONTEXT)).status.ok())
    return false;
  const int n = absl::GetFlag(FLAGS_flood_requests);
  std::vector<v1::GenerateRequest> flood;
  for (int i = 0; i < n; ++i) {
    flood.push_back(TokensRequest("", "flood", History(flood_prompt, 2000 + i), flood_max, v1::FULL_CONTEXT));
  }
  std::vector<Result> flooded;
  const absl::Time start = absl::Now();
  std::thread flooding([&] { flooded = Burst(stub.get(), flood, absl::ZeroDuration()); });
  absl::SleepFor(start + absl::Milliseconds(500) - absl::Now());  // the flood is queued by then
  std::vector<v1::GenerateRequest> quiet;
  for (int i = 0; i < 3; ++i) {
    quiet.push_back(TokensRequest("", "quiet", History(quiet_prompt, 3000 + i), 8, v1::FULL_CONTEXT));
  }
  const std::vector<Result> served = Burst(stub.get(), quiet, absl::Seconds(1));
  flooding.join();
  const double flood_s = absl::ToDoubleSeconds(absl::Now() - start);
  std::vector<double> quiet_ttft, flood_ttft;
  bool ok = true;
  for (const Result& r : served) {
    ok = ok && r.status.ok();
    quiet_ttft.push_back(r.final.usage().time_to_first_token_us() / 1e3);
  }
  for (const Result& r : flooded) {
    ok = ok && r.status.ok();
    flood_ttft.push_back(r.final.usage().time_to_first_token_us() / 1e3);
  }
  if (!ok) {
    std::fprintf(stderr, "a request of the tenant section %s failed\n", name.c_str());
    return false;
  }
  report.metrics["tenant_quiet_ttft_ms_" + name] = Median(quiet_ttft);
  report.metrics["tenant_quiet_ttft_max_ms_" + name] =
      *std::max_element(quiet_ttft.begin(), quiet_ttft.end());
  report.metrics["tenant_flood_ttft_p50_ms_" + name] = Median(flood_ttft);
  report.metrics["tenant_flood_seconds_" + name] = flood_s;
  report.ratio["tenant_quiet_vs_flood_ttft_" + name] = Median(quiet_ttft) / Median(flood_ttft);
  report.notes["tenants_" + name] = absl::StrCat(
      "worker flags ", absl::StrJoin(worker_flags, " "), "; ", n, " concurrent requests of ", flood_prompt,
      " tokens (", flood_max, " generated) from one tenant, then 3 requests of ", quiet_prompt,
      " tokens (8 generated) from another, sent 0.5, 1.5 and 2.5 s after; times to first token from usage");
  return true;
}

// Resident set size of a process in bytes (VmRSS), or 0.
double RssBytes(pid_t pid) {
  std::FILE* f = std::fopen(absl::StrCat("/proc/", pid, "/status").c_str(), "r");
  if (f == nullptr) return 0;
  char line[256];
  double kb = 0;
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    if (std::sscanf(line, "VmRSS: %lf kB", &kb) == 1) break;
  }
  std::fclose(f);
  return kb * 1024;
}

// Opens `n` sessions (forks of `sources`, one client thread per source: a
// source is busy while it is forked) and closes them again. False on any error.
bool ChurnRound(v1::Worker::Stub* stub, const std::vector<std::string>& sources, const std::string& tenant,
                int n) {
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  const int k = static_cast<int>(sources.size());
  for (int t = 0; t < k; ++t) {
    threads.emplace_back([&, t] {
      for (int i = t; i < n; i += k) {
        v1::ForkSessionRequest fr;
        fr.set_session_id(sources[t]);
        fr.set_tenant(tenant);
        fr.set_new_session_id(absl::StrCat("churn-", i));
        v1::SessionInfo info;
        grpc::ClientContext c1;
        failures += !stub->ForkSession(&c1, fr, &info).ok();
      }
      for (int i = t; i < n; i += k) {
        v1::SessionRequest sr;
        sr.set_session_id(absl::StrCat("churn-", i));
        sr.set_tenant(tenant);
        v1::CloseSessionResponse closed;
        grpc::ClientContext c2;
        failures += !stub->CloseSession(&c2, sr, &closed).ok();
      }
    });
  }
  for (auto& th : threads) th.join();
  return failures.load() == 0;
}

int Run() {
  bench::BenchReport report;
  report.benchmark = "worker";
  const std::string sections = absl::GetFlag(FLAGS_sections);
  auto want = [&sections](const char* name) {
    for (absl::string_view part : absl::StrSplit(sections, ',')) {
      if (part == name) return true;
    }
    return false;
  };
  const int threads = absl::GetFlag(FLAGS_threads);
  const std::string worker_bin = testing::BinaryPath("worker/kvcache-worker");
  auto start_worker = [&](const std::string& id) {
    return testing::ServerUnderTest::Start(
        worker_bin, {"--worker_id=" + id, "--threads=" + std::to_string(threads), "--tier0_bytes=1073741824",
                     "--max_batch_tokens=512", "--model=" + gguf::DefaultModelPath()});
  };
  auto w1 = start_worker("bench-1");
  if (!w1.ok()) {
    std::fprintf(stderr, "cannot start the worker: %s\n", w1.status().ToString().c_str());
    return 1;
  }
  auto stub = v1::Worker::NewStub((*w1)->channel());

  const int history = absl::GetFlag(FLAGS_history_tokens);
  if (want("ttft")) {
    // 1. Time to first token of turn N after a long history: cold vs cached.
    const std::vector<int32_t> turn = History(40, 7);
    std::vector<double> cold, cached;
    for (int rep = 0; rep < absl::GetFlag(FLAGS_reps); ++rep) {
      const std::string tenant = absl::StrCat("t", rep);
      const std::vector<int32_t> h = History(history, rep);
      const std::string conv = absl::StrCat("conv-", rep);
      Result built = Call(stub.get(), TokensRequest(conv, tenant, h, 1, v1::FULL_CONTEXT));
      Result hot = Call(stub.get(), TokensRequest(conv, tenant, turn, 1, v1::APPEND));
      std::vector<int32_t> full = h;
      full.insert(full.end(), turn.begin(), turn.end());
      Result fresh = Call(stub.get(), TokensRequest("", tenant + "-cold", full, 1, v1::FULL_CONTEXT));
      if (!built.status.ok() || !hot.status.ok() || !fresh.status.ok()) {
        std::fprintf(stderr, "ttft run failed: %s %s %s\n", built.status.error_message().c_str(),
                     hot.status.error_message().c_str(), fresh.status.error_message().c_str());
        return 1;
      }
      cached.push_back(hot.final.usage().time_to_first_token_us() / 1e3);
      cold.push_back(fresh.final.usage().time_to_first_token_us() / 1e3);
    }
    report.metrics["ttft_cached_ms"] = Median(cached);
    report.baseline["ttft_cold_ms"] = Median(cold);
    report.ratio["ttft_cold_vs_cached"] = Median(cold) / Median(cached);
  }

  // 2. Streaming: decode tokens/s through gRPC vs the engine in-process.
  const int n = absl::GetFlag(FLAGS_decode_tokens);
  const std::vector<int32_t> prompt = History(32, 3);
  std::vector<double> grpc_rates;
  if (want("streaming")) {
    for (int rep = 0; rep < absl::GetFlag(FLAGS_reps); ++rep) {
      Result r = Call(stub.get(), TokensRequest("", "stream", prompt, n, v1::FULL_CONTEXT));
      if (!r.status.ok()) return 1;
      grpc_rates.push_back((r.tokens - 1) / (r.end_s - r.first_token_s));
    }
    report.metrics["grpc_decode_tokens_per_s"] = Median(grpc_rates);
  }

  const int m = absl::GetFlag(FLAGS_migrate_tokens);
  if (want("migration")) {
    // 3. Migration of a long session between two worker processes.
    auto w2 = start_worker("bench-2");
    if (!w2.ok()) return 1;
    std::vector<double> total, pause, bytes;
    for (int rep = 0; rep < absl::GetFlag(FLAGS_reps); ++rep) {
      const std::string id = absl::StrCat("long-", rep);
      Result built = Call(stub.get(), TokensRequest(id, "mig", History(m, 50 + rep), 1, v1::FULL_CONTEXT));
      if (!built.status.ok()) {
        std::fprintf(stderr, "building the long session failed: %s\n", built.status.error_message().c_str());
        return 1;
      }
      grpc::ClientContext ctx;
      v1::MigrateSessionRequest req;
      req.set_session_id(id);
      req.set_tenant("mig");
      req.set_target_address((*w2)->grpc_address());
      v1::MigrateSessionResponse resp;
      grpc::Status st = stub->MigrateSession(&ctx, req, &resp);
      if (!st.ok()) {
        std::fprintf(stderr, "migration failed: %s\n", st.error_message().c_str());
        return 1;
      }
      total.push_back(resp.total_us() / 1e3);
      pause.push_back(resp.pause_us() / 1e3);
      bytes.push_back(static_cast<double>(resp.bytes_moved()));
    }
    report.metrics["migration_total_ms"] = Median(total);
    report.metrics["migration_pause_ms"] = Median(pause);
    report.metrics["migration_bytes"] = Median(bytes);
    report.metrics["migration_gb_per_s"] = Median(bytes) / (Median(total) / 1e3) / 1e9;
  }

  // 4. Bounded state: resident memory after session churn, worker and router.
  if (want("churn")) {
    auto router = testing::ServerUnderTest::Start(
        testing::BinaryPath("router/kvcache-router"),
        {"--workers=" + (*w1)->grpc_address(), "--model=" + gguf::DefaultModelPath(),
         "--rebalance_interval=0s", "--min_ready_workers=1"});
    if (!router.ok()) {
      std::fprintf(stderr, "cannot start the router: %s\n", router.status().ToString().c_str());
      return 1;
    }
    std::vector<std::string> sources;
    for (int t = 0; t < 4; ++t) {
      sources.push_back(absl::StrCat("churn-src-", t));
      if (!Call(stub.get(), TokensRequest(sources.back(), "churn", History(32, 90 + t), 1, v1::FULL_CONTEXT))
               .status.ok()) {
        return 1;
      }
    }
    const int rounds = std::max(2, absl::GetFlag(FLAGS_churn_rounds));
    const int per_round = absl::GetFlag(FLAGS_churn_sessions);
    double worker_first = 0, router_first = 0, worker_last = 0, router_last = 0;
    const absl::Time churn_start = absl::Now();
    for (int round = 0; round < rounds; ++round) {
      if (!ChurnRound(stub.get(), sources, "churn", per_round)) {
        std::fprintf(stderr, "churn round %d failed\n", round);
        return 1;
      }
      worker_last = RssBytes((*w1)->process().pid());
      router_last = RssBytes((*router)->process().pid());
      if (round == 0) {
        worker_first = worker_last;
        router_first = router_last;
      }
    }
    const double churn_s = absl::ToDoubleSeconds(absl::Now() - churn_start);
    report.metrics["worker_rss_after_first_churn_round_mb"] = worker_first / 1e6;
    report.metrics["worker_rss_after_last_churn_round_mb"] = worker_last / 1e6;
    report.metrics["router_rss_after_first_churn_round_mb"] = router_first / 1e6;
    report.metrics["router_rss_after_last_churn_round_mb"] = router_last / 1e6;
    report.metrics["rss_growth_after_churn_worker"] = worker_last / worker_first;
    report.metrics["rss_growth_after_churn_router"] = router_last / router_first;
    report.metrics["rss_growth_after_churn"] =
        std::max(worker_last / worker_first, router_last / router_first);
    report.metrics["churn_sessions_per_s"] = 2.0 * rounds * per_round / churn_s;
    report.notes["churn"] =
        absl::StrCat(rounds, " rounds of ", per_round,
                     " forks then closes of 32-token sessions (4 client threads), a router "
                     "watching; RSS from /proc/PID/status VmRSS after each round");
  }
  if (want("burst") && !SharedPrefixBurst(stub.get(), (*w1)->metrics_port(), report)) return 1;
  w1->reset();

  if (want("router_burst")) {
    std::map<std::string, int> split_one, split_two;
    auto one = RouterBurst(1, &split_one);
    auto two = RouterBurst(2, &split_two);
    if (!one.ok() || !two.ok()) {
      std::fprintf(stderr, "router burst failed: %s\n", (one.ok() ? two : one).status().ToString().c_str());
      return 1;
    }
    report.metrics["burst_one_worker_seconds"] = *one;
    report.metrics["burst_two_workers_seconds"] = *two;
    report.ratio["burst_two_workers_vs_one"] = *one / *two;
    std::string split;
    for (const auto& [w, k] : split_two) absl::StrAppend(&split, split.empty() ? "" : ", ", w, ": ", k);
    report.notes["router_burst"] = absl::StrCat(
        "32 concurrent new sessions (500-token system prompt cached on one worker + 100 private tokens, 16 "
        "generated) through a router; workers of 1 thread each; two-worker split: ",
        split);
  }

  if (want("tenants")) {
    // Queued flood: a free slot goes to the tenant with the fewest running.
    // Running flood: the quiet tenant's prompt competes with every flood prompt.
    if (!TenantFairness("admission", {"--max_running=8"}, 200, 48, 200, report) ||
        !TenantFairness("prefill", {"--max_running=64"}, 600, 8, 900, report)) {
      return 1;
    }
  }

  if (want("streaming")) {
    auto inproc = InProcessDecode(threads, n, prompt);
    if (!inproc.ok()) {
      std::fprintf(stderr, "in-process engine failed: %s\n", inproc.status().ToString().c_str());
      return 1;
    }
    report.baseline["inprocess_decode_tokens_per_s"] = *inproc;
    report.ratio["grpc_vs_inprocess_tokens"] = Median(grpc_rates) / *inproc;
  }
  if (want("ttft") || want("streaming") || want("migration"))
    report.notes["method"] =
        absl::StrCat("SmolLM2-135M Q4_1, ", threads, " threads, medians of ", absl::GetFlag(FLAGS_reps),
                     " reps. TTFT: ", history,
                     "-token synthetic history then a 40-token turn; cached = APPEND on the live "
                     "session, cold = the same ",
                     history + 40,
                     " tokens as FULL_CONTEXT under a fresh tenant (no prefix hits); "
                     "both from the worker's usage.time_to_first_token_us. Streaming: ",
                     n,
                     " greedy tokens, first-to-last token rate, gRPC client in this process vs the same "
                     "engine in-process. "
                     "Migration: ",
                     m, "-token session, worker-to-worker over loopback, from MigrateSessionResponse.");
  return bench::Finish(report).ok() ? 0 : 1;
}

}  // namespace
}  // namespace kvcache

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return kvcache::Run();
}
