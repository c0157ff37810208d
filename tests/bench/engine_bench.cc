// End-to-end benchmark of the serving path: a GGUF (default SmolLM2-135M Q4_1;
// --model for another, e.g. the Q4_K_M file the tests re-quantise) through the
// Engine (continuous batching) on CpuLlamaRunner over the paged KV cache, with
// the same thread count as the llama.cpp baseline. Decode, prefill, batched and
// attention run at every vector kernel level the machine has: keys carry the
// level (`_avx2`, `_avx512`), and the keys without one are the best level's.
//
//   decode:     single stream, greedy, ignore_eos, 128 tokens after a short prompt;
//               tokens/s from the first generated token to the last (no prefill)
//   prefill:    512-token prompt, tokens / time to first token
//   batched:    aggregate decode tokens/s with 1, 4, 16 concurrent sessions, and
//               what bounds batch16_vs_single: the linear layers of a 1- and a
//               16-token step timed alone on the model's weights (the 16 tokens
//               split as the runner splits 16 decodes: step_groups_16_decodes), and
//               the ratio that 16-token time allows (batch16_vs_single_matmul_ceiling); and
//               the ratio a 16-token step allows if its multiply-accumulates ran at
//               the measured peak of the level's integer-dot instruction
//               (batch16_vs_single_int8_peak_ceiling, int8_dot_peak_gmac_per_s);
//               and where the engine's steps of 1 and 16 decodes went, from its
//               step statistics (engine_{step,forward,products,attention}_ms_*)
//   sampled:    1 and 16 sessions decoding as in batched, greedy against
//               temperature 1 (OpenAI's default; every token sampled from the
//               whole vocabulary) and top_p 0.9, at the best level
//               (sampled_vs_greedy_*)
//   arrivals:   beside one decoding stream (best level), 15 requests of 16-token
//               prompts from 15 other tenants arrive at once, then (apart) one of
//               a 1,024-token prompt: their times to first token, and the
//               stream's gaps between tokens meanwhile against its gap alone
//               (what the step-time target trades: engine.h)
//   cache vs recompute: time to generate 256 tokens after a 256 (1024)-token
//               prompt through the engine (KV cache) vs recomputing: a full
//               prefill of the whole context for every new token on the same
//               runner (sampled at a few context lengths, integrated)
//   roofline:   decode_vs_bw_bound = decode tokens/s x weight bytes read per
//               token / the read bandwidth measured in this run (1.0 is the
//               memory-bound limit; llama.cpp has the same one)
//   attention:  one decode token's paged attention over a 4096-token session
//               (all 30 layers, f16 KV) as K/V bytes read per second, divided by
//               the read bandwidth measured right before it (the median of
//               --reps such pairs); its two ceilings: the same attention over
//               one layer's K/V in cache (compute), and the same pages read with
//               no arithmetic (attention_pages_read_fraction: memory as this page
//               layout reads it)
//   llama.cpp:  its own llama-bench (pp512, tg128, same GGUF, same threads),
//               built for this machine (--llama_bench: build_llamacpp.sh native)
//               and, on an AVX-512 machine, without AVX-512 (--llama_bench_avx2:
//               build_llamacpp.sh avx2) to compare with our avx2 level;
//               scripts/bench.sh builds both and passes them.
//
// Rates (ours and llama-bench's) are the median of --reps repetitions, each with a
// `_spread` figure beside it, (max - min) / median of those repetitions: the cores
// are shared, and the spread says how much. The matmul ceilings of the batched
// section are the fastest repetition: a bound is what the kernels can do.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/bench_json.h"
#include "common/gguf/model_path.h"
#include "common/status_macros.h"
#include "common/tokenizer/tokenizer.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "tests/bench/mem_bandwidth.h"
#include "worker/backend/cpu/attention.h"
#include "worker/backend/cpu/compute_pool.h"
#include "worker/backend/cpu/cpu_features.h"
#include "worker/backend/cpu/cpu_llama_runner.h"
#include "worker/backend/cpu/matmul.h"
#include "worker/kv/kv_cache_manager.h"
#include "worker/model/llama_model.h"
#include "worker/sched/engine.h"

ABSL_FLAG(std::string, model, "", "GGUF path (default: DefaultModelPath())");
ABSL_FLAG(int, threads, 2, "kernel threads (and llama.cpp n_threads)");
ABSL_FLAG(int, reps, 5, "repetitions per measurement (rates: the median; ceilings: the fastest)");
ABSL_FLAG(int, recompute_samples, 6, "context lengths sampled for the recompute baseline");
ABSL_FLAG(std::string, llama_bench, "",
          "llama.cpp's llama-bench built for this machine (tests/bench/build_llamacpp.sh native); empty: no "
          "llama.cpp baseline");
ABSL_FLAG(std::string, llama_bench_avx2, "",
          "llama-bench built without AVX-512 (tests/bench/build_llamacpp.sh avx2), the baseline of our avx2 "
          "level on an AVX-512 machine");
ABSL_FLAG(int, sgemm_min_tokens, 0,
          "tokens from which matmuls take dequant+sgemm (cpu::SetSgemmMinTokens; 0: the measured default of "
          "each level)");
ABSL_FLAG(std::string, sections, "decode,prefill,batched,sampled,arrivals,recompute,attention",
          "comma-separated parts to run (for profiling; ratios of parts not run are left out)");

namespace kvcache {
namespace {

using Clock = std::chrono::steady_clock;
double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

constexpr int kMaxBatchTokens = 512;
constexpr int kDecodeTokens = 128;
constexpr int kPrefillTokens = 512;
constexpr int kGenTokens = 256;  // cache vs recompute

// Records when each token arrives and the final result.
class Timeline : public sched::GenerateObserver {
 public:
  void OnToken(int32_t, absl::string_view) override {
    times.push_back(Clock::now());
    if (static_cast<int>(times.size()) == notify_at) reached.Notify();
  }
  void OnDone(const absl::Status& s, const sched::GenerateResult& r) override {
    end = Clock::now();
    status = s;
    result = r;
    done.Notify();
  }
  std::vector<Clock::time_point> times;
  Clock::time_point submitted, end;
  absl::Status status;
  sched::GenerateResult result;
  absl::Notification done;
  int notify_at = -1;  // `reached` is notified when this many tokens have arrived
  absl::Notification reached;
};

struct Setup {
  std::unique_ptr<model::LlamaModel> model;
  std::unique_ptr<tok::Tokenizer> tokenizer;
  std::unique_ptr<kv::KvCacheManager> kv;
  std::unique_ptr<cpu::CpuLlamaRunner> runner;
  std::unique_ptr<sched::Engine> engine;
};

kv::KvShape ShapeOf(const model::LlamaModel& m) {
  const auto& hp = m.hparams();
  return kv::KvShape{static_cast<int>(hp.n_layer),
                     static_cast<int>(hp.n_head_kv),
                     static_cast<int>(hp.head_dim),
                     kv::KvDtype::kF16,
                     16,
                     0};
}

absl::StatusOr<std::unique_ptr<kv::KvCacheManager>> MakeKv(const model::LlamaModel& m, int64_t tokens) {
  kv::KvCacheOptions ko;
  ko.shape = ShapeOf(m);
  ko.model_id = m.model_id();
  ko.tier0_bytes = (tokens / ko.shape.page_tokens + 1) * ko.shape.page_bytes();
  KVCACHE_ASSIGN_OR_RETURN(std::unique_ptr<kv::KvCacheManager> kv, kv::KvCacheManager::Create(ko));
  // Fault the tier-0 slab in before anything is timed. It is mapped lazily, so
  // each page's first write faults; a long-running worker has written its slab
  // long since, and these figures are a warm worker's. The first touch also
  // varies by machine: a freshly booted VM here took ~3 s per GiB, 0.2 s once
  // the host had backed its memory, and unwarmed it put ~1.2 ms of faults into
  // each 16-session decode step of the first level measured.
  for (int64_t p = 0; p < kv->tier_capacity_pages(0); ++p) {
    std::memset(kv->Tier0PageData(static_cast<kv::PageId>(p)), 0, static_cast<size_t>(ko.shape.page_bytes()));
  }
  return kv;
}

// A prompt of exactly n tokens: English prose (repeated) so the tokenizer and the
// model see ordinary text. `salt` varies the start so prompts differ.
std::vector<int32_t> Prompt(const tok::Tokenizer& t, int n, int salt) {
  static const char* kText =
      "The history of computing is a story of layered abstractions. Engineers built "
      "machines from relays, then vacuum tubes, then transistors, and each generation "
      "of hardware invited a new generation of software that hid the details below it. ";
  std::string text = absl::StrCat("Note ", salt, ": ");
  std::vector<int32_t> ids;
  while (static_cast<int>(ids.size()) < n) {
    text += kText;
    ids = t.Encode(text, {.add_special = true});
  }
  ids.resize(n);
  return ids;
}

// Submits the requests at once and waits for all of them.
absl::Status RunAll(sched::Engine& engine, std::vector<sched::GenerateRequest> reqs,
                    std::vector<std::unique_ptr<Timeline>>* out) {
  out->clear();
  for (auto& r : reqs) {
    out->push_back(std::make_unique<Timeline>());
    out->back()->submitted = Clock::now();
    absl::StatusOr<uint64_t> id = engine.Submit(std::move(r), out->back().get());
    if (!id.ok()) return id.status();
  }
  for (auto& t : *out) {
    t->done.WaitForNotification();
    if (!t->status.ok()) return t->status;
  }
  return absl::OkStatus();
}

int g_tenant = 0;
sched::GenerateRequest Greedy(std::vector<int32_t> input, int max_tokens) {
  sched::GenerateRequest r;
  r.tenant = absl::StrCat("t", ++g_tenant);  // a fresh tenant: no prefix-cache hits
  r.input = std::move(input);
  r.max_tokens = max_tokens;
  r.ignore_eos = true;
  return r;
}

// Medians over an engine's steps of one shape, in milliseconds: the step, its
// forward pass, the products and attention within it (sched::StepStats), the
// rest of the forward pass, and the engine's own part of the step, each the
// median of that part per step.
struct StepSplit {
  int steps = 0;
  double step_ms = 0, forward_ms = 0, products_ms = 0, attention_ms = 0, rest_ms = 0, own_ms = 0;
};

StepSplit MedianSplit(const std::vector<sched::StepStats>& stats) {
  if (stats.empty()) return {};
  std::vector<double> step, forward, products, attention, rest, own;
  for (const sched::StepStats& st : stats) {
    step.push_back(absl::ToDoubleMilliseconds(st.duration));
    forward.push_back(absl::ToDoubleMilliseconds(st.forward));
    products.push_back(absl::ToDoubleMilliseconds(st.products));
    attention.push_back(absl::ToDoubleMilliseconds(st.attention));
    rest.push_back(forward.back() - products.back() - attention.back());
    own.push_back(step.back() - forward.back());
  }
  return StepSplit{
      static_cast<int>(stats.size()), bench::Median(step), bench::Median(forward), bench::Median(products),
      bench::Median(attention),       bench::Median(rest), bench::Median(own)};
}

// Collects, while it lives, the engine's steps (Engine::SetStepCallback) that
// decode exactly n sequences and prefill nothing. The engine may still be calling
// a callback it copied when the collector goes, so the steps live as long as the
// last callback.
class DecodeStepCollector {
 public:
  DecodeStepCollector(sched::Engine& engine, int n) : engine_(engine), shared_(std::make_shared<Shared>()) {
    engine_.SetStepCallback([shared = shared_, n](const sched::StepStats& st) {
      if (st.sequences != n || st.decode_tokens != n || st.prefill_tokens != 0) return;
      absl::MutexLock lock(&shared->mu);
      shared->steps.push_back(st);
    });
  }
  ~DecodeStepCollector() { engine_.SetStepCallback(nullptr); }
  DecodeStepCollector(const DecodeStepCollector&) = delete;
  DecodeStepCollector& operator=(const DecodeStepCollector&) = delete;

  std::vector<sched::StepStats> Steps() const {
    absl::MutexLock lock(&shared_->mu);
    return shared_->steps;
  }

 private:
  struct Shared {
    absl::Mutex mu;
    std::vector<sched::StepStats> steps ABSL_GUARDED_BY(mu);
  };
  sched::Engine& engine_;
  const std::shared_ptr<Shared> shared_;
};

// Aggregate decode tokens/s of n sessions (16-token prompts, 64 tokens each)
// decoding together with `sampling`, `reps` times: the window runs from the step
// where the last one got its first token to the first one's last token. A run
// whose window holds less than half of the n sessions' tokens did not measure n
// sessions decoding together, and runs again (up to 2 * reps more runs; each
// counted in *rerun). That happens: submitted one by one, the first request can
// start alone, and then the step-time target leaves the others' prompts a few
// tokens a step (engine.h) until it ends (16 sessions, when they took turns
// round robin: 15 first tokens at 377 ms against 115 in the other runs, Intel
// Xeon, avx512).
absl::StatusOr<std::vector<double>> BatchedDecodeTokensPerSecond(sched::Engine& engine,
                                                                 const tok::Tokenizer& tk, int n, int reps,
                                                                 const model::SamplingConfig& sampling,
                                                                 int* rerun) {
  constexpr int kGen = 64;
  std::vector<double> rates;
  std::vector<std::unique_ptr<Timeline>> tl;
  for (int run = 0; run < 3 * reps && static_cast<int>(rates.size()) < reps; ++run) {
    std::vector<sched::GenerateRequest> reqs;
    for (int i = 0; i < n; ++i) {
      reqs.push_back(Greedy(Prompt(tk, 16, 100 + i), kGen));
      reqs.back().sampling = sampling;
      reqs.back().sampling.seed = static_cast<uint64_t>(i + 1);
    }
    KVCACHE_RETURN_IF_ERROR(RunAll(engine, std::move(reqs), &tl));
    Clock::time_point from = tl[0]->times.front(), to = tl[0]->times.back();
    for (const auto& t : tl) {
      from = std::max(from, t->times.front());
      to = std::min(to, t->times.back());
    }
    int64_t tokens = 0;
    for (const auto& t : tl) {
      for (const auto& x : t->times) tokens += x > from && x <= to;
    }
    if (tokens < int64_t{n} * kGen / 2) {
      ++*rerun;
      continue;
    }
    rates.push_back(tokens / Seconds(from, to));
  }
  if (rates.empty()) {
    return absl::InternalError(
        absl::StrCat("the ", n, " sessions never decoded together in ", 3 * reps, " runs"));
  }
  return rates;
}

// What requests arriving beside one decoding stream wait, and what the stream
// pays: once the stream has 16 tokens out, `n` requests of `prompt_tokens` from n
// other tenants arrive at once (one token each). Milliseconds: their times to
// first token (median and largest), the stream's gap between tokens alone (the
// median of its first 16), and its median and largest gap from their arrival
// to the last first token.
struct Arrivals {
  double ttft_p50 = 0, ttft_max = 0, gap_alone = 0, gap_p50 = 0, gap_max = 0;
};
absl::StatusOr<Arrivals> ArrivalsBesideAStream(sched::Engine& engine, const tok::Tokenizer& tk, int n,
                                               int prompt_tokens, int salt) {
  constexpr int kBefore = 16;
  Timeline stream;
  stream.notify_at = kBefore + 1;
  stream.submitted = Clock::now();
  KVCACHE_ASSIGN_OR_RETURN(const uint64_t stream_id,
                           engine.Submit(Greedy(Prompt(tk, 16, salt), 4096), &stream));
  stream.reached.WaitForNotification();
  std::vector<std::unique_ptr<Timeline>> tl;
  std::vector<sched::GenerateRequest> reqs;
  for (int i = 0; i < n; ++i) reqs.push_back(Greedy(Prompt(tk, prompt_tokens, salt + 1 + i), 1));
  const Clock::time_point arrived = Clock::now();
  const absl::Status st = RunAll(engine, std::move(reqs), &tl);
  engine.Cancel(stream_id);
  stream.done.WaitForNotification();
  KVCACHE_RETURN_IF_ERROR(st);
  auto ms = [](Clock::time_point a, Clock::time_point b) { return Seconds(a, b) * 1e3; };
  std::vector<double> ttft, alone, beside;
  double ttft_max = 0;
  Clock::time_point last_first = arrived;
  for (const auto& t : tl) {
    ttft.push_back(ms(t->submitted, t->times.front()));
    ttft_max = std::max(ttft_max, ms(t->submitted, t->times.front()));
    last_first = std::max(last_first, t->times.front());
  }
  double gap_max = 0;
  for (size_t i = 1; i < stream.times.size(); ++i) {
    const double gap = ms(stream.times[i - 1], stream.times[i]);
    if (i <= kBefore) alone.push_back(gap);
    if (stream.times[i] > arrived && stream.times[i - 1] <= last_first) {
      beside.push_back(gap);
      gap_max = std::max(gap_max, gap);
    }
  }
  return Arrivals{bench::Median(ttft), ttft_max, bench::Median(alone), bench::Median(beside), gap_max};
}

// The linear layers of one forward step of n tokens on the model's own weights
// (q/k/v and gate/up sharing their input, as CpuLlamaRunner runs them; the output
// head for every token, as a step of n sessions needs): seconds, fastest of `reps`,
// and multiply-accumulates per token in *macs. With groups > 1 the layers' products
// run as the runner runs a grouped step (CpuLlamaRunner::PlanGroups): each of
// `groups` threads takes its share of the tokens through every layer, and the
// head is split by rows.
absl::StatusOr<double> StepMatMulSeconds(const cpu::CpuModelWeights& m, int n, int reps, double* macs,
                                         int groups = 1) {
  std::vector<model::WeightView> all;
  for (const cpu::CpuModelWeights::Layer& l : m.layers()) {
    for (const cpu::KernelWeight* w : {&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down})
      all.push_back(w->view);
  }
  all.push_back(m.output().view);
  int64_t width = 0, rows = 0;
  *macs = 0;
  for (const model::WeightView& w : all) {
    width = std::max(width, w.cols);
    rows = std::max(rows, w.rows);
    *macs += static_cast<double>(w.rows) * static_cast<double>(w.cols);
  }
  std::mt19937 rng(7);
  std::normal_distribution<float> dist;
  std::vector<float> x(static_cast<size_t>(n * width));
  for (float& v : x) v = dist(rng);
  // Outputs per group, so that no two threads write one line.
  std::vector<std::vector<float>> y(3 * static_cast<size_t>(groups),
                                    std::vector<float>(static_cast<size_t>(n * rows)));
  auto layers = [&](int g, int t0, int nt) -> absl::Status {
    const float* xg = x.data() + t0 * width;
    float *y0 = y[3 * g].data(), *y1 = y[3 * g + 1].data(), *y2 = y[3 * g + 2].data();
    for (const cpu::CpuModelWeights::Layer& l : m.layers()) {
      const cpu::MatMulOutput qkv[] = {{l.wq, y0}, {l.wk, y1}, {l.wv, y2}};
      KVCACHE_RETURN_IF_ERROR(cpu::MatMulSameInput(qkv, xg, nt));
      KVCACHE_RETURN_IF_ERROR(cpu::MatMul(l.wo, xg, nt, y0));
      const cpu::MatMulOutput gate_up[] = {{l.w_gate, y0}, {l.w_up, y1}};
      KVCACHE_RETURN_IF_ERROR(cpu::MatMulSameInput(gate_up, xg, nt));
      KVCACHE_RETURN_IF_ERROR(cpu::MatMul(l.w_down, xg, nt, y0));
    }
    return absl::OkStatus();
  };
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const auto start = Clock::now();
    if (groups <= 1) {
      KVCACHE_RETURN_IF_ERROR(layers(0, 0, n));
    } else {
      std::vector<absl::Status> status(groups);
      cpu::ComputePool::Get().ParallelFor(groups, groups, [&](int64_t g) {
        const int t0 = static_cast<int>(g * n / groups), t1 = static_cast<int>((g + 1) * n / groups);
        status[g] = layers(static_cast<int>(g), t0, t1 - t0);
      });
      for (const absl::Status& st : status) KVCACHE_RETURN_IF_ERROR(st);
    }
    KVCACHE_RETURN_IF_ERROR(cpu::MatMul(m.output(), x.data(), n, y[0].data()));
    best = std::min(best, Seconds(start, Clock::now()));
  }
  return best;
}

// Full prefill of `tokens` in a fresh session of `kv` on `runner` (chunks of the
// runner's max_batch_tokens, logits for the last one); returns seconds.
absl::StatusOr<double> TimePrefill(kv::KvCacheManager& kv, cpu::CpuLlamaRunner& runner,
                                   const std::vector<int32_t>& tokens) {
  static int n = 0;
  const std::string id = absl::StrCat("recompute", ++n);
  if (absl::Status st = kv.CreateSession(id, "recompute"); !st.ok()) return st;
  std::vector<float> logits;
  const auto start = Clock::now();
  for (size_t i = 0; i < tokens.size(); i += kMaxBatchTokens) {
    const size_t len = std::min<size_t>(kMaxBatchTokens, tokens.size() - i);
    absl::StatusOr<kv::StepReservation> res = kv.BeginStep(id, static_cast<int64_t>(len));
    if (!res.ok()) return res.status();
    model::SequenceStep s;
    s.tokens = absl::MakeConstSpan(tokens).subspan(i, len);
    s.first_pos = res->first_pos;
    s.page_table = res->page_table;
    s.want_logits = i + len == tokens.size();
    if (absl::Status st = runner.Forward({s}, &logits); !st.ok()) return st;
    if (absl::Status st = kv.CommitStep(id, s.tokens); !st.ok()) return st;
  }
  const double t = Seconds(start, Clock::now());
  if (absl::Status st = kv.CloseSession(id); !st.ok()) return st;
  return t;
}

// llama.cpp's own figures on the same GGUF, from its llama-bench.
struct LlamaCppRun {
  std::vector<double> decode;   // tg128: tokens/s of each repetition
  std::vector<double> prefill;  // pp512: tokens/s of each repetition
  std::string about;            // version, build flags, CPU, whether weights were repacked
};

// Runs `cmd`, returns its stdout and exit status.
std::pair<std::string, int> RunCommand(const std::string& cmd) {
  FILE* p = popen(cmd.c_str(), "r");
  std::string text;
  char buf[4096];
  while (p != nullptr && fgets(buf, sizeof(buf), p) != nullptr) text += buf;
  return {text, p != nullptr ? pclose(p) : -1};
}

// The CPU switches (GGML_NATIVE, GGML_AVX*, GGML_AMX*, ...) that are ON in the
// llama.cpp build of `bin_dir`.
std::string LlamaCppBuildFlags(const std::string& bin_dir) {
  std::ifstream f(bin_dir + "/../CMakeCache.txt");
  std::vector<std::string> on;
  for (std::string line; std::getline(f, line);) {
    const size_t colon = line.find(":BOOL=ON");
    if (colon == std::string::npos) continue;
    for (const char* prefix : {"GGML_NATIVE", "GGML_AVX", "GGML_AMX", "GGML_FMA", "GGML_F16C", "GGML_BMI2",
                               "GGML_SSE", "GGML_OPENMP", "GGML_LLAMAFILE", "GGML_CPU_REPACK"}) {
      if (line.rfind(prefix, 0) == 0) on.push_back(line.substr(0, colon));
    }
  }
  return on.empty() ? "unknown" : absl::StrJoin(on, " ");
}

// llama-bench -p 512 -n 128 on `model_path`. Weights are repacked as llama.cpp
// does by default; when that run fails (its AMX repacking crashes on VMs that
// advertise AMX without granting it), again with --repack 0, and `about` says so.
absl::StatusOr<LlamaCppRun> RunLlamaBench(const std::string& llama_bench, const std::string& model_path,
                                          int threads, int reps) {
  std::string text, repack = "repacked (llama.cpp's default)";
  int rc = -1;
  for (const char* flag : {"1", "0"}) {
    // llama.cpp with its own OpenMP defaults, whatever the caller's environment sets.
    std::tie(text, rc) =
        RunCommand(absl::StrCat("env -u OMP_WAIT_POLICY -u GOMP_SPINCOUNT '", llama_bench, "' -m '",
                                model_path, "' -t ", threads, " -p ", kPrefillTokens, " -n ", kDecodeTokens,
                                " -r ", reps, " --repack ", flag, " -o json 2>/dev/null"));
    if (rc == 0) break;
    repack = "not repacked (--repack 1 failed on this machine)";
  }
  google::protobuf::ListValue tests;
  if (rc != 0 || !google::protobuf::util::JsonStringToMessage(text, &tests).ok()) {
    return absl::UnavailableError(absl::StrCat(llama_bench, " failed (rc ", rc, "): ", text.substr(0, 300)));
  }
  LlamaCppRun run;
  std::string cpu;
  for (const auto& t : tests.values()) {
    const auto& f = t.struct_value().fields();
    std::vector<double>& to = f.at("n_gen").number_value() > 0 ? run.decode : run.prefill;
    for (const auto& x : f.at("samples_ts").list_value().values()) to.push_back(x.number_value());
    cpu = f.at("cpu_info").string_value();
  }
  if (bench::Median(run.decode) <= 0 || bench::Median(run.prefill) <= 0)
    return absl::UnavailableError("llama-bench reported no pp/tg figures");
  const std::string bin_dir = llama_bench.substr(0, llama_bench.rfind('/'));
  std::string version = RunCommand(absl::StrCat("'", bin_dir, "/llama-server' --version 2>&1")).first;
  std::replace(version.begin(), version.end(), '\n', ' ');
  run.about = absl::StrCat("llama.cpp ", absl::StripAsciiWhitespace(version),
                           "; CPU switches ON: ", LlamaCppBuildFlags(bin_dir), "; CPU ", cpu, "; weights ",
                           repack, "; llama-bench median of ", reps, " reps (its OpenMP defaults), tg",
                           kDecodeTokens, " from an empty context, pp", kPrefillTokens);
  return run;
}

int Main() {
  bench::BenchReport report;
  report.benchmark = "engine";
  const int threads = absl::GetFlag(FLAGS_threads);
  const int reps = absl::GetFlag(FLAGS_reps);
  cpu::SetSgemmMinTokens(absl::GetFlag(FLAGS_sgemm_min_tokens));
  std::string model_path = absl::GetFlag(FLAGS_model);
  if (model_path.empty()) model_path = gguf::DefaultModelPath();
  auto fail = [](const absl::Status& st) {
    std::fprintf(stderr, "engine_bench: %s\n", st.ToString().c_str());
    return 1;
  };

  Setup s;
  {
    auto m = model::LlamaModel::Load(model_path);
    if (!m.ok()) return fail(m.status());
    s.model = std::move(*m);
    auto t = tok::Tokenizer::FromGguf(s.model->file());
    if (!t.ok()) return fail(t.status());
    s.tokenizer = std::move(*t);
    auto kv = MakeKv(*s.model, 16384);
    if (!kv.ok()) return fail(kv.status());
    s.kv = std::move(*kv);
    auto r = cpu::CpuLlamaRunner::Create(s.model.get(), s.kv.get(), {kMaxBatchTokens, threads});
    if (!r.ok()) return fail(r.status());
    s.runner = std::move(*r);
    sched::EngineOptions eo;
    eo.max_batch_tokens = kMaxBatchTokens;
    auto e = sched::Engine::Create(eo, s.runner.get(), s.kv.get(), s.tokenizer.get());
    if (!e.ok()) return fail(e.status());
    s.engine = std::move(*e);
  }
  report.metrics["threads"] = threads;
  report.notes["kernel_level"] = cpu::CpuKernelLevelName(cpu::GetCpuKernelLevel());
  report.notes["model"] = model_path;
  const tok::Tokenizer& tk = *s.tokenizer;
  std::vector<std::unique_ptr<Timeline>> tl;
  int rerun = 0;  // batched runs whose sessions did not decode together (BatchedDecodeTokensPerSecond)

  const std::string sections = absl::GetFlag(FLAGS_sections);
  auto want = [&](const char* name) { return sections.find(name) != std::string::npos; };

  // The vector kernel levels, best first; `put` records a figure under the
  // level's key and, for the best level, under the plain key too.
  const cpu::CpuKernelLevel best = cpu::MaxSupportedCpuKernelLevel();
  std::vector<cpu::CpuKernelLevel> levels;
  for (cpu::CpuKernelLevel level : cpu::SupportedCpuKernelLevels()) {
    if (level != cpu::CpuKernelLevel::kScalar) levels.insert(levels.begin(), level);
  }
  if (levels.empty()) levels.push_back(best);
  auto put = [&](std::map<std::string, double>& to, const std::string& key, cpu::CpuKernelLevel level,
                 double v) {
    to[absl::StrCat(key, "_", cpu::CpuKernelLevelName(level))] = v;
    if (level == best) to[key] = v;
  };
  // A rate: its median under `key`, and how its repetitions spread under key_spread.
  auto put_samples = [&](std::map<std::string, double>& to, const std::string& key, cpu::CpuKernelLevel level,
                         const std::vector<double>& samples) {
    put(to, key, level, bench::Median(samples));
    put(to, key + "_spread", level, bench::Spread(samples));
  };
  auto set_level = [&](cpu::CpuKernelLevel level) {
    if (absl::Status st = cpu::SetCpuKernelLevel(level); !st.ok()) {
      std::fprintf(stderr, "engine_bench: %s\n", st.ToString().c_str());
      std::exit(1);
    }
  };

  // The decode roofline: one token reads every weight matrix once (the embedding
  // table only when it is also the output matrix), so bandwidth / those bytes
  // bounds single-stream decode.
  const double bw = bench::MeasureReadBandwidth(threads);
  double weight_bytes = 0;
  const bool tied = s.model->file().FindTensor("output.weight") == nullptr;
  for (const auto& t : s.model->file().tensors()) {
    if (t.name != "token_embd.weight" || tied) weight_bytes += static_cast<double>(t.size_bytes);
  }
  report.metrics["mem_read_bw_gb_per_s"] = bw / 1e9;
  report.baseline["mem_read_bw_gb_per_s"] = bw / 1e9;
  report.metrics["decode_weight_mb_per_token"] = weight_bytes / 1e6;
  report.baseline["decode_bw_bound_tokens_per_s"] = bw / weight_bytes;

  const std::vector<int32_t> decode_prompt = Prompt(tk, 16, 1);
  const std::vector<int32_t> prefill_prompt = Prompt(tk, kPrefillTokens, 2);
  std::map<cpu::CpuKernelLevel, std::vector<double>> decode_single, prefill;  // rates of each rep
  for (cpu::CpuKernelLevel level : levels) {
    set_level(level);
    // Warm-up: page in the weights, grow scratch buffers.
    if (auto st = RunAll(*s.engine, {Greedy(Prompt(tk, 64, 0), 8)}, &tl); !st.ok()) return fail(st);

    // ---- single-stream decode.
    for (int r = 0; r < reps && want("decode"); ++r) {
      if (auto st = RunAll(*s.engine, {Greedy(decode_prompt, kDecodeTokens)}, &tl); !st.ok()) return fail(st);
      const auto& times = tl[0]->times;
      decode_single[level].push_back((times.size() - 1) / Seconds(times.front(), times.back()));
    }
    if (want("decode")) {
      put_samples(report.metrics, "decode_tokens_per_s_single", level, decode_single[level]);
      put(report.ratio, "decode_vs_bw_bound", level, bench::Median(decode_single[level]) * weight_bytes / bw);
    }

    // ---- prefill (time to first token of a 512-token prompt).
    for (int r = 0; r < reps && want("prefill"); ++r) {
      if (auto st = RunAll(*s.engine, {Greedy(prefill_prompt, 1)}, &tl); !st.ok()) return fail(st);
      if (tl[0]->result.cached_tokens != 0) return fail(absl::InternalError("prefill hit the prefix cache"));
      prefill[level].push_back(kPrefillTokens / absl::ToDoubleSeconds(tl[0]->result.time_to_first_token));
    }
    if (want("prefill")) put_samples(report.metrics, "prefill_tokens_per_s", level, prefill[level]);

    // ---- batched decode: N sessions decoding together.
    std::map<int, double> batched;   // medians
    std::map<int, StepSplit> split;  // the engine's steps of 1 and 16 decodes
    for (int n : {1, 4, 16}) {
      if (!want("batched")) break;
      absl::StatusOr<std::vector<double>> rates;
      {
        DecodeStepCollector collect(*s.engine, n);
        rates = BatchedDecodeTokensPerSecond(*s.engine, tk, n, reps, model::SamplingConfig{}, &rerun);
        if (n != 4) split[n] = MedianSplit(collect.Steps());
      }
      if (!rates.ok()) return fail(rates.status());
      batched[n] = bench::Median(*rates);
      put_samples(report.metrics, absl::StrCat("batched_decode_tokens_per_s_", n, "_sessions"), level,
                  *rates);
    }
    if (want("batched")) {
      put(report.ratio, "batch16_vs_single", level, batched[16] / batched[1]);
      // What bounds that ratio: a step of 16 sessions is no faster than its matmuls.
      double macs = 0;
      absl::StatusOr<double> mm1 = StepMatMulSeconds(s.runner->weights(), 1, 5 * reps, &macs);  // 6 ms each
      // As the runner would run a step of 16 decodes: split by rows, or in groups.
      std::vector<model::SequenceStep> decodes(16);
      const int32_t token = 1;
      for (model::SequenceStep& d : decodes) {
        d.tokens = absl::MakeConstSpan(&token, 1);
        d.first_pos = 48;
      }
      const std::vector<size_t> plan = s.runner->PlanGroups(decodes);
      const int groups = plan.empty() ? 1 : static_cast<int>(plan.size()) - 1;
      put(report.metrics, "step_groups_16_decodes", level, groups);
      absl::StatusOr<double> mm16 = StepMatMulSeconds(s.runner->weights(), 16, reps, &macs, groups);
      if (!mm1.ok()) return fail(mm1.status());
      if (!mm16.ok()) return fail(mm16.status());
      put(report.metrics, "step_matmuls_ms_1_token", level, *mm1 * 1e3);
      put(report.metrics, "step_matmuls_ms_16_tokens", level, *mm16 * 1e3);
      // Where the engine's own steps of 1 and 16 decodes went (medians over them).
      for (int n : {1, 16}) {
        if (split[n].steps == 0) {
          return fail(absl::InternalError(absl::StrCat("no engine step decoded ", n, " sessions alone")));
        }
        const std::string what = n == 1 ? "1_decode" : absl::StrCat(n, "_decodes");
        put(report.metrics, "engine_step_ms_" + what, level, split[n].step_ms);
        put(report.metrics, "engine_forward_ms_" + what, level, split[n].forward_ms);
        put(report.metrics, "engine_products_ms_" + what, level, split[n].products_ms);
        put(report.metrics, "engine_attention_ms_" + what, level, split[n].attention_ms);
      }
      const StepSplit& s16 = split[16];
      put(report.metrics, "step_matmuls_gmac_per_s_16_tokens", level, 16 * macs / *mm16 / 1e9);
      const double ceiling = 16 / *mm16 / batched[1];
      put(report.ratio, "batch16_vs_single_matmul_ceiling", level, ceiling);
      // And what the machine allows at all: the step's multiply-accumulates at the
      // peak rate of the level's integer-dot instruction, nothing else.
      const double peak = bench::MeasureInt8DotPeak(threads, level >= cpu::CpuKernelLevel::kAvx512);
      const double peak_ceiling = 16 / (16 * macs / peak) / batched[1];
      put(report.baseline, "int8_dot_peak_gmac_per_s", level, peak / 1e9);
      put(report.ratio, "step_matmuls_16_tokens_vs_int8_dot_peak", level, 16 * macs / *mm16 / peak);
      put(report.ratio, "batch16_vs_single_int8_peak_ceiling", level, peak_ceiling);
      report.notes["batch16_bound_" + std::string(cpu::CpuKernelLevelName(level))] = absl::StrFormat(
          "compute: the matmuls of a 16-token step (%s) take %.1f ms (%.0f GMAC/s, %.2f of this machine's "
          "measured %s peak of %.0f GMAC/s; one token's take %.1f ms, %.2f of the bandwidth roofline), so "
          "against one session's %.0f tokens/s batch16_vs_single cannot exceed %.2f with these kernels, "
          "nor %.2f with any kernel built on that instruction. In the engine, a step of 16 decodes took "
          "%.1f ms (median of %d such steps): its forward pass %.1f ms, %s; the engine's own part of the "
          "step (sampling, K/V commits, streaming) %.1f ms",
          groups > 1 ? absl::StrCat("the layers' in ", groups,
                                    " groups of sessions, one a thread, as the "
                                    "runner runs that step; the head split by rows")
                     : std::string("each split by rows over the threads, as the runner runs that step"),
          *mm16 * 1e3, 16 * macs / *mm16 / 1e9, 16 * macs / *mm16 / peak,
          level >= cpu::CpuKernelLevel::kAvx512 ? "vpdpbusd" : "vpmaddubsw+vpaddw", peak / 1e9, *mm1 * 1e3,
          weight_bytes / bw / *mm1, batched[1], ceiling, peak_ceiling, s16.step_ms, s16.steps, s16.forward_ms,
          s16.products_ms > 0
              ? absl::StrFormat("of which the products %.1f ms (timed alone above: %.1f), attention %.1f ms, "
                                "and norms, RoPE, K/V writes, SwiGLU and adds %.1f ms",
                                s16.products_ms, *mm16 * 1e3, s16.attention_ms, s16.rest_ms)
              : std::string("whose products and attention are not timed apart (its layers ran as groups)"),
          s16.own_ms);
    }
  }
  set_level(best);  // the rest runs at the best level

  // ---- sampled decode: what OpenAI clients send by default (temperature 1, no
  // top-k, top_p 1) and a nucleus (top_p 0.9), against greedy at the same level.
  if (want("sampled")) {
    const struct {
      const char* name;
      model::SamplingConfig config;
    } kSampling[] = {{"greedy", {}}, {"t1", {1.0f, 0, 1.0f, 0}}, {"t1_top_p_0_9", {1.0f, 0, 0.9f, 0}}};
    for (int n : {1, 16}) {
      double greedy = 0;
      for (const auto& sampling : kSampling) {
        absl::StatusOr<std::vector<double>> rates =
            BatchedDecodeTokensPerSecond(*s.engine, tk, n, reps, sampling.config, &rerun);
        if (!rates.ok()) return fail(rates.status());
        const double rate = bench::Median(*rates);
        const std::string key = absl::StrCat("sampled_decode_tokens_per_s_", n, "_sessions_", sampling.name);
        report.metrics[key] = rate;
        report.metrics[key + "_spread"] = bench::Spread(*rates);
        if (greedy == 0) {
          greedy = rate;
        } else {
          report.ratio[absl::StrCat("sampled_vs_greedy_", n, "_sessions_", sampling.name)] = rate / greedy;
        }
      }
    }
  }

  // ---- arrivals beside a stream (ArrivalsBesideAStream), the median of reps.
  if (want("arrivals")) {
    const struct {
      const char* name;
      int n, prompt_tokens;
    } kCases[] = {{"15_short_prompts", 15, 16}, {"long_prompt", 1, 1024}};
    for (const auto& c : kCases) {
      std::vector<double> ttft_p50, ttft_max, gap_alone, gap_p50, gap_max;
      for (int r = 0; r < reps; ++r) {
        absl::StatusOr<Arrivals> a =
            ArrivalsBesideAStream(*s.engine, tk, c.n, c.prompt_tokens, 1000 + 100 * r);
        if (!a.ok()) return fail(a.status());
        ttft_p50.push_back(a->ttft_p50);
        ttft_max.push_back(a->ttft_max);
        gap_alone.push_back(a->gap_alone);
        gap_p50.push_back(a->gap_p50);
        gap_max.push_back(a->gap_max);
      }
      const std::string k = absl::StrCat("arrivals_", c.name, "_");
      report.metrics[k + "ttft_p50_ms"] = bench::Median(ttft_p50);
      report.metrics[k + "ttft_max_ms"] = bench::Median(ttft_max);
      report.metrics[k + "stream_gap_alone_ms"] = bench::Median(gap_alone);
      report.metrics[k + "stream_gap_p50_ms"] = bench::Median(gap_p50);
      report.metrics[k + "stream_gap_max_ms"] = bench::Median(gap_max);
    }
  }

  // ---- cache vs recompute, part 1: the engine generates 256 tokens (cached).
  struct RecomputeCase {
    int prompt_len;
    double cached;
    std::vector<int32_t> context;  // prompt + generated tokens
  };
  std::vector<RecomputeCase> recompute_cases;
  for (int prompt_len : {256, 1024}) {
    if (!want("recompute")) break;
    RecomputeCase rc{prompt_len, 1e30, Prompt(tk, prompt_len, 3 + prompt_len)};
    std::vector<int32_t> generated;
    for (int r = 0; r < std::max(1, reps - 1); ++r) {
      if (auto st = RunAll(*s.engine, {Greedy(rc.context, kGenTokens)}, &tl); !st.ok()) return fail(st);
      rc.cached = std::min(rc.cached, absl::ToDoubleSeconds(tl[0]->result.total_time));
      generated = tl[0]->result.output;
    }
    rc.context.insert(rc.context.end(), generated.begin(), generated.end());
    recompute_cases.push_back(std::move(rc));
  }

  // Every kernel from here on runs on this thread. Stop the engine's thread
  // first, so that the process has one thread running kernels, as a worker does.
  s.engine.reset();

  // ---- cache vs recompute, part 2: the baseline, a second KV cache and runner
  // on the same model.
  auto kv2 = MakeKv(*s.model, 4096 + 64);
  if (!kv2.ok()) return fail(kv2.status());
  auto runner2 = cpu::CpuLlamaRunner::Create(s.model.get(), kv2->get(), {kMaxBatchTokens, threads});
  if (!runner2.ok()) return fail(runner2.status());
  const int samples = std::max(2, absl::GetFlag(FLAGS_recompute_samples));
  for (const RecomputeCase& rc : recompute_cases) {
    const int prompt_len = rc.prompt_len;
    const double cached = rc.cached;
    const std::vector<int32_t>& context = rc.context;
    // Token i (0-based) needs a prefill of prompt_len + i tokens. Sample the cost at
    // `samples` evenly spaced i, best of 2 each, and sum the linear interpolation
    // over every i in [0, kGenTokens).
    std::vector<std::pair<int, double>> pts;
    for (int j = 0; j < samples; ++j) {
      const int i = j * (kGenTokens - 1) / (samples - 1);
      const std::vector<int32_t> ctx(context.begin(), context.begin() + prompt_len + i);
      double best = 1e30;
      for (int r = 0; r < 2; ++r) {
        absl::StatusOr<double> t = TimePrefill(**kv2, **runner2, ctx);
        if (!t.ok()) return fail(t.status());
        best = std::min(best, *t);
      }
      pts.push_back({i, best});
    }
    double recompute = 0;
    for (size_t j = 0; j + 1 < pts.size(); ++j) {
      const auto [i0, t0] = pts[j];
      const auto [i1, t1] = pts[j + 1];
      for (int i = i0; i < i1 + (j + 2 == pts.size() ? 1 : 0); ++i) {
        recompute += t0 + (t1 - t0) * (i - i0) / (i1 - i0);
      }
    }
    const std::string key = absl::StrCat("_", prompt_len);
    report.metrics["cache_generate_256_s" + key] = cached;
    report.baseline["recompute_generate_256_s" + key] = recompute;
    report.ratio["cache_vs_recompute" + key] = recompute / cached;
  }

  // ---- decode attention over a 4096-token session, all layers, f16 KV, pages as
  // the KV cache lays them out (K/V content is random: the bytes read are what count).
  if (want("attention")) {
    const int ctx = 4096;
    kv::KvCacheManager& kv = **kv2;
    if (auto st = kv.CreateSession("attn", "attn"); !st.ok()) return fail(st);
    absl::StatusOr<kv::StepReservation> res = kv.BeginStep("attn", ctx);
    if (!res.ok()) return fail(res.status());
    const kv::KvShape sh = ShapeOf(*s.model);
    kv::PageLayout L{sh.layers, sh.kv_heads, sh.head_dim, sh.page_tokens, kv::KvDtype::kF16};
    void* base = kv.Tier0PageData(0);
    std::mt19937 rng(7);
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    std::vector<float> rows(static_cast<size_t>(L.row_elems()) * L.page_tokens);
    for (float& v : rows) v = dist(rng);
    const std::vector<int32_t> table(res->page_table.begin(), res->page_table.end());
    for (int p = 0; p < ctx / L.page_tokens; ++p) {
      for (int l = 0; l < L.layers; ++l) {
        if (auto st =
                cpu::WriteKv(L, base, table, l, p * L.page_tokens, L.page_tokens, rows.data(), rows.data());
            !st.ok()) {
          return fail(st);
        }
      }
    }
    const int n_heads = static_cast<int>(s.model->hparams().n_head);
    std::vector<float> q(static_cast<size_t>(n_heads) * L.head_dim), out(q.size());
    for (float& v : q) v = dist(rng);
    cpu::AttentionParams ap;
    ap.layout = L;
    ap.kv_base = base;
    ap.n_heads = n_heads;
    const cpu::AttentionSeq seq{table, ctx, 1};
    auto step = [&] {
      for (int l = 0; l < L.layers; ++l) {
        ap.layer = l;
        (void)cpu::PagedAttention(ap, {seq}, q.data(), out.data());
      }
    };
    // The same work on one layer's K/V, read L.layers times: after the first pass
    // it comes from cache (where it fits), so its rate is what these kernels reach
    // when memory does not stall them, the ceiling of the fraction from DRAM.
    auto step_cached = [&] {
      ap.layer = 0;
      for (int l = 0; l < L.layers; ++l) (void)cpu::PagedAttention(ap, {seq}, q.data(), out.data());
    };
    const double bytes = double{1} * L.layers * ctx * 2 * L.row_bytes();
    const double layer_bytes = bytes / L.layers;
    // The same K/V bytes read with no arithmetic, layer by layer, each page's K
    // block and then its V block, in tasks of 16 pages (about an attention item):
    // what memory gives any kernel on this page layout and page table.
    std::vector<bench::Piece> pieces;
    const int64_t block_bytes = int64_t{L.page_tokens} * L.row_bytes();
    for (int l = 0; l < L.layers; ++l) {
      for (int p = 0; p < ctx / L.page_tokens; ++p) {
        pieces.push_back({L.page(base, table[p]) + L.k_offset(l, 0), block_bytes});
        pieces.push_back({L.page(base, table[p]) + L.v_offset(l, 0), block_bytes});
      }
    }
    // The read bandwidth of this shared machine moves by up to 1.8x between
    // minutes, so each repetition measures it right before its attention runs and
    // the fraction is the median of those pairs.
    for (cpu::CpuKernelLevel level : levels) {
      set_level(level);
      step();
      double best_s = 1e30, best_cached_s = 1e30;
      std::vector<double> fractions, cached_fractions, bws, pages_fractions, pages_bws;
      auto best_of_5 = [](auto&& f) {
        double best = 1e30;
        for (int r = 0; r < 5; ++r) {
          const auto start = Clock::now();
          f();
          best = std::min(best, Seconds(start, Clock::now()));
        }
        return best;
      };
      for (int rep = 0; rep < reps; ++rep) {
        const double rep_bw = bench::MeasureReadBandwidth(threads);
        const double rep_pages_bw = bench::MeasurePiecesReadBandwidth(threads, pieces, 32);
        const double rep_s = best_of_5(step);
        const double rep_cached_s = best_of_5(step_cached);
        best_s = std::min(best_s, rep_s);
        best_cached_s = std::min(best_cached_s, rep_cached_s);
        fractions.push_back(bytes / rep_s / rep_bw);
        cached_fractions.push_back(bytes / rep_cached_s / rep_bw);
        bws.push_back(rep_bw);
        pages_fractions.push_back(rep_pages_bw / rep_bw);
        pages_bws.push_back(rep_pages_bw);
      }
      const double pages_fraction = bench::Median(pages_fractions);
      const double pages_bw = bench::Median(pages_bws);
      put(report.metrics, "attention_pages_read_gb_per_s", level, pages_bw / 1e9);
      put(report.ratio, "attention_pages_read_fraction", level, pages_fraction);
      std::sort(fractions.begin(), fractions.end());
      std::sort(cached_fractions.begin(), cached_fractions.end());
      std::sort(bws.begin(), bws.end());
      const double fraction = fractions[fractions.size() / 2];
      const double ceiling = cached_fractions[cached_fractions.size() / 2];
      put(report.metrics, "attention_cached_layer_ms", level, best_cached_s * 1e3);
      put(report.ratio, "attention_cached_bw_fraction", level, ceiling);
      const int64_t l3 = cpu::L3CacheBytes();
      // The lower of the two ceilings names the resource: the kernels' arithmetic,
      // or memory as this page layout reads it.
      const double bound = std::min({ceiling, pages_fraction, 1.0});
      report.notes["attention_bound_" + std::string(cpu::CpuKernelLevelName(level))] = absl::StrFormat(
          "%s: the same attention over one layer's K/V (%.1f MB%s) read %d times takes %.2f ms, %.2f of the "
          "read bandwidth measured beside it, so with these kernels attention_bw_fraction cannot exceed "
          "%.2f here; reading the same pages in the same order with no arithmetic runs at %.1f GB/s, %.2f of "
          "that bandwidth (attention_pages_read_fraction), the most any kernel on this page layout can "
          "reach; over all %d layers from memory it takes %.2f ms (%.2f)%s",
          ceiling <= pages_fraction ? "compute" : "memory (the pages' read rate)", layer_bytes / 1e6,
          l3 > 0 ? absl::StrFormat(", L3 %.0f MiB", l3 / 1048576.0) : std::string(", L3 size unknown"),
          L.layers, best_cached_s * 1e3, ceiling, std::min(ceiling, 1.0), pages_bw / 1e9, pages_fraction,
          L.layers, best_s * 1e3, fraction,
          fraction < 0.9 * bound
              ? ": the rest is memory time that these kernels do not hide behind their arithmetic"
              : "");
      put(report.metrics, "attention_decode_ctx4096_ms", level, best_s * 1e3);
      put(report.metrics, "attention_kv_gb_per_s", level, bytes / best_s / 1e9);
      put(report.metrics, "attention_paired_read_bw_gb_per_s", level, bws[bws.size() / 2] / 1e9);
      put(report.ratio, "attention_bw_fraction", level, fraction);
    }
    set_level(best);
    (void)kv.AbortStep("attn");
    (void)kv.CloseSession("attn");
  }

  // ---- llama.cpp baseline: its llama-bench on the same GGUF and threads, built
  // for this machine (against our best level) and without AVX-512 (against our
  // avx2 level).
  struct Baseline {
    std::string llama_bench;
    cpu::CpuKernelLevel level;
  };
  std::vector<Baseline> baselines;
  if (!absl::GetFlag(FLAGS_llama_bench).empty())
    baselines.push_back({absl::GetFlag(FLAGS_llama_bench), best});
  if (!absl::GetFlag(FLAGS_llama_bench_avx2).empty() && best != cpu::CpuKernelLevel::kAvx2) {
    baselines.push_back({absl::GetFlag(FLAGS_llama_bench_avx2), cpu::CpuKernelLevel::kAvx2});
  }
  if (baselines.empty()) report.notes["llamacpp"] = "skipped: no --llama_bench (scripts/bench.sh passes it)";
  for (const Baseline& b : baselines) {
    if (!want("decode") || !want("prefill")) break;
    const std::string level = cpu::CpuKernelLevelName(b.level);
    absl::StatusOr<LlamaCppRun> lc = RunLlamaBench(b.llama_bench, model_path, threads, reps);
    if (!lc.ok()) {
      report.notes["llamacpp_" + level] = lc.status().ToString();
      continue;
    }
    put_samples(report.baseline, "llamacpp_decode_tokens_per_s", b.level, lc->decode);
    put_samples(report.baseline, "llamacpp_prefill_tokens_per_s", b.level, lc->prefill);
    const double their_decode = bench::Median(lc->decode), their_prefill = bench::Median(lc->prefill);
    put(report.ratio, "decode_vs_llamacpp", b.level, bench::Median(decode_single[b.level]) / their_decode);
    put(report.ratio, "prefill_vs_llamacpp", b.level, bench::Median(prefill[b.level]) / their_prefill);
    put(report.baseline, "llamacpp_decode_vs_bw_bound", b.level, their_decode * weight_bytes / bw);
    // What bounds the decode ratio: both engines near the bandwidth roofline
    // leave little room for one to lead the other.
    const double ours = bench::Median(decode_single[b.level]) * weight_bytes / bw,
                 theirs = their_decode * weight_bytes / bw;
    report.notes["decode_bound_" + level] = absl::StrFormat(
        "memory bandwidth: %.1f MB of weights a token at %.1f GB/s bound decode to %.0f tokens/s; ours "
        "reaches %.2f of it, llama.cpp %.2f, so decode_vs_llamacpp cannot exceed %.2f here",
        weight_bytes / 1e6, bw / 1e9, bw / weight_bytes, ours, theirs, 1.0 / theirs);
    report.notes["llamacpp_" + level] = lc->about;
  }
  if (want("batched") || want("sampled")) report.metrics["batched_runs_rerun"] = rerun;
  report.notes["method"] = absl::StrCat(
      "rates: median of ", reps,
      " reps, with (max - min) / median as <key>_spread; step matmuls: fastest of ", reps,
      " reps (5x for one token); decode: ", kDecodeTokens,
      " greedy tokens after a 16-token prompt, timed first "
      "token to last; prefill: ",
      kPrefillTokens,
      "-token prompt / time to first token; batched: N sessions x 64 "
      "tokens submitted together, tokens emitted while all N decode / that window (a run whose window "
      "holds less than half their tokens runs again: batched_runs_rerun); engine_*_ms_N_decodes: medians "
      "over the engine's own steps of N decodes in those runs (its step statistics: the step, its forward "
      "pass, the products and attention in it); arrivals: one stream decodes, and "
      "after its 16th token 15 requests of 16-token prompts (or one of 1,024) from other tenants arrive at "
      "once; their times to first token and the stream's gaps meanwhile, medians over reps; "
      "cache_vs_recompute: "
      "engine "
      "total time for prompt + 256 tokens vs the sum over the 256 tokens of a full prefill of the context so "
      "far "
      "on the same runner, measured at ",
      samples,
      " evenly spaced context lengths (best of 2) and linearly "
      "interpolated; attention: one decode token over a 4096-token session, all layers, random f16 K/V, "
      "best of 5 after a read-bandwidth measurement, per rep; the fraction is the median over reps of those "
      "pairs; attention_cached: the same on one layer's K/V, read as many times as there are layers, "
      "best of 5 in the same reps, paired the same way; attention_pages_read: the same K/V bytes read "
      "with no arithmetic (each page's K block, then its V block, layer by layer, 16 pages a task over the "
      "threads), best of 5 passes in the same reps, paired the same way");
  return bench::Finish(report).ok() ? 0 : 1;
}

}  // namespace
}  // namespace kvcache

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return kvcache::Main();
}
