// Whole-model logits of the CUDA runner against the CPU runner, on tiny Llama
// models (every weight type the device reads, and a Q4_K_M-like mix; GQA 8/2,
// head_dim 64) and on SmolLM2's shapes (the real file when present, else a
// synthetic Q4_1 model of its shapes):
// batched chunked prefill of three sessions of different lengths, then batched
// decode, teacher-forced with the same tokens on both backends.
//
// The CPU runner is forced onto its exact path (weights dequantised to f32,
// sgemm; no 8-bit activations), so the difference is the GPU's f16 activations
// (and f16 weight slices in prompt steps): tolerance max |gpu - cpu| <= 2% of
// the largest |logit| + 0.01. Steps of up to 128 tokens replay CUDA graphs;
// GraphStepsMatchEagerStepsAndCpu checks them against eager steps too.
#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/gguf/gguf_reader.h"
#include "common/gguf/model_path.h"
#include "common/gguf/tiny_llama.h"
#include "gtest/gtest.h"
#include "tests/common/gguf/reference_data.h"
#include "tests/worker/backend/cuda/gpu_test_util.h"
#include "tests/worker/model/greedy_reference.h"
#include "worker/backend/cpu/cpu_llama_runner.h"
#include "worker/backend/cpu/matmul.h"
#include "worker/backend/cuda/cuda_backend.h"
#include "worker/backend/cuda/cuda_llama_runner.h"
#include "worker/kv/kv_cache_manager.h"

extern "C" kvcache::backend::CudaBackendFactory* kvcache_cuda_backend_v1();

namespace kvcache::cuda {
namespace {

struct Engine {
  std::unique_ptr<kv::KvCacheManager> kv;
  model::ModelRunnerPtr runner;
};

Engine MakeEngine(const model::LlamaModel& m, backend::CudaBackend* gpu, bool graphs = true) {
  const auto& hp = m.hparams();
  kv::KvCacheOptions o;
  o.shape = kv::KvShape{static_cast<int>(hp.n_layer),
                        static_cast<int>(hp.n_head_kv),
                        static_cast<int>(hp.head_dim),
                        kv::KvDtype::kF16,
                        16,
                        0};
  o.model_id = m.model_id();
  o.tier0_bytes = 256 * o.shape.page_bytes();
  if (gpu != nullptr) o.storage_factory = gpu->MakeTierStorageFactory();
  Engine e;
  e.kv = std::move(kv::KvCacheManager::Create(o)).value();
  if (gpu != nullptr) {
    auto r = gpu->CreateRunner(m, e.kv->tier_storage(0), o.shape, {256, graphs});
    EXPECT_TRUE(r.ok()) << r.status();
    if (r.ok()) e.runner = std::move(*r);
  } else {
    e.runner = std::move(cpu::CpuLlamaRunner::Create(&m, e.kv.get(), {256, 0})).value();
  }
  return e;
}

// One batched step: tokens[i] appended to session "s<i>"; returns the logits.
std::vector<float> Step(Engine& e, const std::vector<std::vector<int32_t>>& tokens) {
  std::vector<kv::StepReservation> res;
  std::vector<model::SequenceStep> steps;
  for (size_t i = 0; i < tokens.size(); ++i) {
    auto r = e.kv->BeginStep("s" + std::to_string(i), static_cast<int64_t>(tokens[i].size()));
    EXPECT_TRUE(r.ok()) << r.status();
    res.push_back(std::move(*r));
  }
  for (size_t i = 0; i < tokens.size(); ++i) {
    model::SequenceStep s;
    s.tokens = tokens[i];
    s.first_pos = res[i].first_pos;
    s.page_table = res[i].page_table;
    s.want_logits = true;
    steps.push_back(s);
  }
  std::vector<float> logits;
  const absl::Status st = e.runner->Forward(steps, &logits);
  EXPECT_TRUE(st.ok()) << st;
  for (size_t i = 0; i < tokens.size(); ++i)
    EXPECT_TRUE(e.kv->CommitStep("s" + std::to_string(i), tokens[i]).ok());
  return logits;
}

void CompareBackends(const model::LlamaModel& m, const std::string& label) {
  auto backend = kvcache_cuda_backend_v1()->Create({0});
  ASSERT_TRUE(backend.ok()) << backend.status();
  cpu::SetSgemmMinTokens(1);  // exact CPU reference path
  Engine c = MakeEngine(m, nullptr), g = MakeEngine(m, backend->get());
  ASSERT_NE(g.runner, nullptr);
  const int64_t vocab = m.hparams().n_vocab;
  std::mt19937 rng(5);
  const int n_seq = 3;
  const int lens[n_seq] = {70, 300, 9};
  for (int i = 0; i < n_seq; ++i) {
    ASSERT_TRUE(c.kv->CreateSession("s" + std::to_string(i), "t").ok());
    ASSERT_TRUE(g.kv->CreateSession("s" + std::to_string(i), "t").ok());
  }
  float worst = 0, worst_rel = 0;
  int argmax_agree = 0, steps = 0;
  auto compare = [&](const std::vector<float>& a, const std::vector<float>& b) {
    ASSERT_EQ(a.size(), b.size());
    for (size_t r = 0; r * vocab < a.size(); ++r) {
      float scale = 0, diff = 0;
      for (int64_t v = 0; v < vocab; ++v) {
        scale = std::max(scale, std::fabs(a[r * vocab + v]));
        diff = std::max(diff, std::fabs(a[r * vocab + v] - b[r * vocab + v]));
      }
      EXPECT_LE(diff, 0.02f * scale + 0.01f) << label << " row " << r;
      worst = std::max(worst, diff);
      worst_rel = std::max(worst_rel, diff / std::max(scale, 1e-6f));
      const auto am = std::max_element(a.begin() + r * vocab, a.begin() + (r + 1) * vocab) - a.begin();
      const auto bm = std::max_element(b.begin() + r * vocab, b.begin() + (r + 1) * vocab) - b.begin();
      argmax_agree += am == bm;
      ++steps;
    }
  };
  // Chunked prefill: two chunks per prompt, all sessions in each step.
  std::vector<std::vector<int32_t>> prompts(n_seq);
  for (int i = 0; i < n_seq; ++i) {
    for (int j = 0; j < lens[i]; ++j) prompts[i].push_back(static_cast<int32_t>(rng() % vocab));
  }
  for (int chunk = 0; chunk < 2; ++chunk) {
    std::vector<std::vector<int32_t>> part(n_seq);
    for (int i = 0; i < n_seq; ++i) {
      const int half = lens[i] / 2;
      part[i].assign(prompts[i].begin() + (chunk == 0 ? 0 : half),
                     chunk == 0 ? prompts[i].begin() + half : prompts[i].end());
    }
    compare(Step(c, part), Step(g, part));
  }
  // Batched decode, teacher-forced with the CPU's greedy tokens.
  std::vector<float> last;
  for (int s = 0; s < 12; ++s) {
    std::vector<std::vector<int32_t>> next(n_seq, std::vector<int32_t>{static_cast<int32_t>(rng() % vocab)});
    const std::vector<float> a = Step(c, next), b = Step(g, next);
    compare(a, b);
  }
  std::printf("%s: %d logit rows, max |gpu - cpu| = %.4f (%.3f%% of max |logit|), argmax equal %d/%d\n",
              label.c_str(), steps, worst, 100 * worst_rel, argmax_agree, steps);
  cpu::SetSgemmMinTokens(0);
}

std::unique_ptr<model::LlamaModel> Tiny(gguf::TinyLlamaOptions o) {
  auto bytes = gguf::BuildTinyLlama(o);
  EXPECT_TRUE(bytes.ok()) << bytes.status();
  auto file = gguf::GgufFile::OpenFromBuffer(std::move(*bytes));
  EXPECT_TRUE(file.ok()) << file.status();
  auto m = model::LlamaModel::FromFile(std::move(*file));
  EXPECT_TRUE(m.ok()) << m.status();
  return std::move(*m);
}

// 3 layers, 512 wide, GQA 8/2, FFN 1024 (whole K-quant super-blocks), `type` weights.
gguf::TinyLlamaOptions TinyOptions(gguf::GgmlType type) {
  gguf::TinyLlamaOptions o;
  o.n_layer = 3;
  o.n_embd = 512;
  o.n_head = 8;
  o.n_head_kv = 2;
  o.n_ff = 1024;
  o.n_ctx = 1024;
  o.weight_type = type;
  o.weight_scale = 0.08f;
  return o;
}

TEST(CudaRunnerTest, TinyModelLogitsMatchCpu) {
  KVCACHE_REQUIRE_GPU();
  for (gguf::GgmlType type :
       {gguf::GgmlType::kF16, gguf::GgmlType::kQ8_0, gguf::GgmlType::kQ4_1, gguf::GgmlType::kQ4_0,
        gguf::GgmlType::kQ5_0, gguf::GgmlType::kQ4_K, gguf::GgmlType::kQ5_K, gguf::GgmlType::kQ6_K}) {
    gguf::TinyLlamaOptions o = TinyOptions(type);
    o.tied_embeddings = type != gguf::GgmlType::kQ8_0;
    CompareBackends(*Tiny(o), std::string("tiny ") + std::string(gguf::TypeName(type)));
  }
}

// A mix like llama.cpp's Q4_K_M, with Q, K and V in three types: the fused QKV
// product runs as three parts writing at their row offsets, in decode (MatVec)
// and prefill (dequantised slices + cuBLAS) steps.
TEST(CudaRunnerTest, MixedQuantTypesMatchCpu) {
  KVCACHE_REQUIRE_GPU();
  gguf::TinyLlamaOptions o = TinyOptions(gguf::GgmlType::kQ4_K);
  o.type_overrides = {{"attn_k.weight", gguf::GgmlType::kQ5_0},
                      {"attn_v.weight", gguf::GgmlType::kQ6_K},
                      {"ffn_down.weight", gguf::GgmlType::kQ6_K},
                      {"ffn_up.weight", gguf::GgmlType::kQ8_0},
                      {"output.weight", gguf::GgmlType::kQ6_K}};
  o.tied_embeddings = false;
  CompareBackends(*Tiny(o), "tiny q4_K/q5_0/q6_K/q8_0 mix");
}

// Every architecture's features (Llama 3.1 rope_freqs, Qwen 2 biases and NeoX
// RoPE, Qwen 3 Q/K norms): the models arch_reference_test checks against llama.cpp.
// The CUDA attention runs head sizes 32, 64 and 128: the reference models' 16
// widens to 32 (they are compared with the CPU here, not with llama.cpp), and
// their context to CompareBackends' 312 positions.
TEST(CudaRunnerTest, ArchitecturesMatchCpu) {
  KVCACHE_REQUIRE_GPU();
  for (gguf::NamedTinyModel m : gguf::ArchitectureReferenceModels()) {
    gguf::TinyLlamaOptions& o = m.options;
    if (o.head_dim == 0 && o.n_embd / o.n_head < 32) o.n_embd = 32 * o.n_head;
    o.n_ctx = std::max<int64_t>(o.n_ctx, 512);
    CompareBackends(*Tiny(o), m.name);
  }
}

// Steps of up to 128 tokens replay CUDA graphs, padded to a bucket width; every
// step here is checked against an eager GPU runner (tighter tolerance: only the
// padded widths' GEMM choices differ) and the CPU. The schedule crosses token
// buckets with and without padding, a step too wide for a graph, and decode past
// 256 keys (two attention splits: a new graph).
TEST(CudaRunnerTest, GraphStepsMatchEagerStepsAndCpu) {
  KVCACHE_REQUIRE_GPU();
  gguf::TinyLlamaOptions o = TinyOptions(gguf::GgmlType::kQ4_K);
  auto m = Tiny(o);
  auto backend = std::move(kvcache_cuda_backend_v1()->Create({0})).value();
  cpu::SetSgemmMinTokens(1);
  Engine c = MakeEngine(*m, nullptr), e = MakeEngine(*m, backend.get(), false),
         g = MakeEngine(*m, backend.get(), true);
  ASSERT_NE(e.runner, nullptr);
  ASSERT_NE(g.runner, nullptr);
  for (int i = 0; i < 4; ++i) {
    for (Engine* x : {&c, &e, &g}) ASSERT_TRUE(x->kv->CreateSession("s" + std::to_string(i), "t").ok());
  }
  const int64_t vocab = m->hparams().n_vocab;
  std::mt19937 rng(9);
  std::vector<std::vector<int>> schedule = {{20, 13, 2, 5}, {1, 1, 9, 1}};
  for (int i = 0; i < 20; ++i) schedule.push_back({1, 1, 1});
  // 102 tokens, padded to 128; then 132 tokens, eager in every runner; then
  // decode with session 0 past 256 keys.
  schedule.push_back({100, 1, 1});
  schedule.push_back({130, 1, 1});
  for (int i = 0; i < 5; ++i) schedule.push_back({1, 1, 1});
  int steps = 0;
  for (const std::vector<int>& lens : schedule) {
    std::vector<std::vector<int32_t>> tokens;
    for (int n : lens) {
      tokens.emplace_back();
      for (int j = 0; j < n; ++j) tokens.back().push_back(static_cast<int32_t>(rng() % vocab));
    }
    const std::vector<float> lc = Step(c, tokens), le = Step(e, tokens), lg = Step(g, tokens);
    ASSERT_EQ(lg.size(), lens.size() * vocab);
    ASSERT_EQ(le.size(), lg.size());
    ASSERT_EQ(lc.size(), lg.size());
    for (size_t r = 0; r < lens.size(); ++r) {
      float scale = 0, vs_eager = 0, vs_cpu = 0;
      for (int64_t v = 0; v < vocab; ++v) {
        const size_t at = r * vocab + v;
        scale = std::max(scale, std::fabs(lc[at]));
        vs_eager = std::max(vs_eager, std::fabs(lg[at] - le[at]));
        vs_cpu = std::max(vs_cpu, std::fabs(lg[at] - lc[at]));
      }
      EXPECT_LE(vs_eager, 0.002f * scale + 0.002f) << "step " << steps << " row " << r;
      EXPECT_LE(vs_cpu, 0.02f * scale + 0.01f) << "step " << steps << " row " << r;
    }
    ++steps;
  }
  cpu::SetSgemmMinTokens(0);
  // Keys (padded tokens, logit rows, splits): (48,4,1) (16,4,1) (4,4,1) (128,4,1) (4,4,2).
  const CudaGraphStats gs = GetCudaGraphStats(*g.runner), es = GetCudaGraphStats(*e.runner);
  std::printf("graphs: %lld captured, %lld replays, %lld eager steps %s\n",
              static_cast<long long>(gs.captures), static_cast<long long>(gs.replays),
              static_cast<long long>(gs.eager_steps), gs.error.c_str());
  EXPECT_EQ(gs.error, "");
  EXPECT_EQ(gs.captures, 5);
  EXPECT_EQ(gs.replays, steps - 1);
  EXPECT_EQ(gs.eager_steps, 1);
  EXPECT_EQ(es.replays, 0);
  EXPECT_EQ(es.eager_steps, steps);
}

TEST(CudaRunnerTest, SmolLM2LogitsMatchCpu) {
  KVCACHE_REQUIRE_GPU();
  auto real = model::LlamaModel::Load(gguf::DefaultModelPath());
  if (real.ok()) {
    CompareBackends(**real, "SmolLM2-135M-Instruct Q4_1");
    return;
  }
  // SmolLM2's shapes with random Q4_1 weights (the model file is not on this machine).
  gguf::TinyLlamaOptions o = gguf::SmolLM2ShapedOptions();
  o.weight_scale = 0.06f;
  CompareBackends(*Tiny(o), "synthetic SmolLM2-shaped Q4_1");
}

// The CPU engine's teacher-forced greedy test on the GPU runner: llama.cpp's
// greedy tokens for the recorded prompts (tests/data/llamacpp_greedy.json), fed
// back one at a time; every step where llama.cpp's top-2 margin is at least 0.5
// must have llama.cpp's token as our argmax. Needs the real SmolLM2 Q4_1 file
// (KVCACHE_MODEL; tests/gpu/run.sh joins the parts split_model.sh carries).
TEST(CudaRunnerTest, GreedyDecisionsMatchLlamaCppOnTheRealModel) {
  KVCACHE_REQUIRE_GPU();
  auto real = model::LlamaModel::Load(gguf::DefaultModelPath());
  ASSERT_TRUE(real.ok())
      << real.status()
      << " (on a GPU machine, tests/gpu/run.sh joins the parts tests/gpu/split_model.sh carries)";
  auto ref = ::kvcache::testing::LoadReference("llamacpp_greedy.json");
  ASSERT_TRUE(ref.ok()) << ref.status();
  auto backend = kvcache_cuda_backend_v1()->Create({0});
  ASSERT_TRUE(backend.ok()) << backend.status();
  kv::KvCacheOptions ko = ::kvcache::testing::ReferenceKvOptions(**real, kv::KvDtype::kF16);
  ko.storage_factory = (*backend)->MakeTierStorageFactory();
  auto kv = kv::KvCacheManager::Create(ko);
  ASSERT_TRUE(kv.ok()) << kv.status();
  auto runner = (*backend)->CreateRunner(**real, (*kv)->tier_storage(0), ko.shape, {256});
  ASSERT_TRUE(runner.ok()) << runner.status();
  ::kvcache::testing::ReferenceEngine engine(std::move(*kv), std::move(*runner));
  int index = 0, decided = 0, agree = 0;
  for (const auto& p : ref->fields().at("prompts").list_value().values()) {
    const std::string name = p.struct_value().fields().at("name").string_value();
    SCOPED_TRACE(name);
    const ::kvcache::testing::GreedyComparison c = ::kvcache::testing::CompareWithLlamaCppGreedy(
        engine, "gpu-" + std::to_string(index++), p.struct_value(), 32, 0.5f, "gpu " + name);
    decided += c.decided;
    agree += c.agree;
  }
  std::printf("GPU greedy vs llama.cpp: %d/%d decisions with margin >= 0.5 equal over %d prompts\n", agree,
              decided, index);
  EXPECT_GE(index, 4);
  EXPECT_GT(decided, 0);
}

// A step whose bucket is wider than max_batch_tokens (97 tokens pad to 128; the
// runner's activations hold 100) runs eagerly instead of overrunning them.
TEST(CudaRunnerTest, GraphBucketsStayWithinMaxBatchTokens) {
  KVCACHE_REQUIRE_GPU();
  auto m = Tiny(TinyOptions(gguf::GgmlType::kQ8_0));
  auto backend = std::move(kvcache_cuda_backend_v1()->Create({0})).value();
  Engine g = MakeEngine(*m, backend.get());
  auto r = backend->CreateRunner(*m, g.kv->tier_storage(0), g.kv->shape(), {100, true});
  ASSERT_TRUE(r.ok()) << r.status();
  g.runner = std::move(*r);
  ASSERT_TRUE(g.kv->CreateSession("s0", "t").ok());
  std::vector<int32_t> tokens(97);
  for (int i = 0; i < 97; ++i) tokens[i] = i % 300;
  const std::vector<float> logits = Step(g, {tokens});
  EXPECT_EQ(logits.size(), static_cast<size_t>(m->hparams().n_vocab));
  const CudaGraphStats gs = GetCudaGraphStats(*g.runner);
  EXPECT_EQ(gs.eager_steps, 1);
  EXPECT_EQ(gs.replays, 0);
  const std::vector<std::vector<int32_t>> one = {std::vector<int32_t>{7}};
  EXPECT_EQ(Step(g, one).size(), static_cast<size_t>(m->hparams().n_vocab));  // 1 token: a graph
  EXPECT_EQ(GetCudaGraphStats(*g.runner).replays, 1);
}

TEST(CudaRunnerTest, BadBatchIsInvalidArgumentAndTheRunnerKeepsWorking) {
  KVCACHE_REQUIRE_GPU();
  gguf::TinyLlamaOptions o;
  o.n_embd = 256;
  o.n_head = 4;
  o.n_head_kv = 2;
  auto m = Tiny(o);
  auto backend = std::move(kvcache_cuda_backend_v1()->Create({0})).value();
  Engine g = MakeEngine(*m, backend.get());
  ASSERT_TRUE(g.kv->CreateSession("s0", "t").ok());
  auto r = g.kv->BeginStep("s0", 1);
  ASSERT_TRUE(r.ok());
  const std::vector<int32_t> bad = {static_cast<int32_t>(m->hparams().n_vocab)};
  model::SequenceStep s{bad, 0, r->page_table, true};
  std::vector<float> logits;
  EXPECT_EQ(g.runner->Forward({s}, &logits).code(), absl::StatusCode::kInvalidArgument);
  const std::vector<int32_t> good = {5};
  s.tokens = good;
  EXPECT_TRUE(g.runner->Forward({s}, &logits).ok());
  EXPECT_EQ(logits.size(), static_cast<size_t>(m->hparams().n_vocab));
}

}  // namespace
}  // namespace kvcache::cuda
