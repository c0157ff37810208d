// The CPU forward pass on the real SmolLM2-135M-Instruct (Q4_1), checked two ways.
//
// 1. Exact math: with f32 KV and every matmul on dequantised f32 weights (no
//    activation quantisation), first-step logits equal a float64 numpy forward
//    pass (tests/data/record_fp64_reference.py) within 2e-3.
// 2. Against llama.cpp (tests/data/record_model_reference.py): the serving path
//    (f16 KV, 8-bit activation blocks dotted with Q4_1 / Q8_0 weights, as
//    llama.cpp does) is teacher-forced along llama.cpp's 32 greedy tokens of every
//    prompt; at each step our argmax must equal llama.cpp's token whenever
//    llama.cpp's own top-2 margin is at least kNearTie. Both engines quantise
//    activations to 8 bits per 32-value block with different rounding and
//    summation order. Against the float64 pass, our serving path's first-step
//    top-20 logit gaps (logit minus the top logit) are off by up to 0.81 (0.93
//    with the previous attention kernel; ServingPathGapsNearFloat64 prints them
//    and bounds them by kServingTolerance), and the two engines' gaps differ by
//    up to 0.63 (0.43 before); their top-2 margins differ by up to ~0.9 at some
//    steps. A step whose margin is below kNearTie = 0.5 is decided by rounding
//    noise between two correct implementations, not by ours being right or
//    wrong: those steps are counted and printed, not asserted. First-step top-20
//    logit gaps agree with llama.cpp's within kLogitTolerance.
#include <chrono>
#include <cmath>
#include <string>
#include <vector>

#include "absl/base/casts.h"
#include "absl/time/time.h"
#include "common/gguf/model_path.h"
#include "gtest/gtest.h"
#include "tests/common/gguf/reference_data.h"
#include "tests/worker/model/greedy_reference.h"
#include "worker/backend/cpu/cpu_features.h"
#include "worker/backend/cpu/cpu_llama_runner.h"
#include "worker/backend/cpu/matmul.h"
#include "worker/model/llama_model.h"
#include "worker/model/sampler.h"

namespace kvcache {
namespace {

constexpr int kGreedyTokens = 32;
constexpr float kLogitTolerance = 0.8f;
constexpr float kServingTolerance = 1.0f;
constexpr float kNearTie = 0.5f;

class LlamaReferenceTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto m = model::LlamaModel::Load(gguf::DefaultModelPath());
    ASSERT_TRUE(m.ok()) << m.status();
    model_ = std::move(*m).release();
  }
  static void TearDownTestSuite() {
    delete model_;
    model_ = nullptr;
  }

  void SetUp() override { Build(kv::KvDtype::kF16); }

  void Build(kv::KvDtype dtype) {
    ASSERT_NE(model_, nullptr);
    engine_ = std::make_unique<testing::ReferenceEngine>(model_, dtype);
    ASSERT_TRUE(engine_->ok());
    kv_ = engine_->kv();
  }

  std::vector<float> Step(const std::string& id, const std::vector<int32_t>& tokens) {
    return engine_->Step(id, tokens);
  }

  static model::LlamaModel* model_;
  std::unique_ptr<testing::ReferenceEngine> engine_;
  kv::KvCacheManager* kv_ = nullptr;  // engine_'s
};

model::LlamaModel* LlamaReferenceTest::model_ = nullptr;

// The runner multiplies by load-time re-laid copies (InterleaveRows16) of every
// quantised matrix of the model: without them each step would take the slower
// row-by-row route with the same results, which no other test would notice.
TEST_F(LlamaReferenceTest, RunnerHoldsEveryQuantisedMatrixInterleaved) {
  const cpu::CpuModelWeights weights(*model_);
  int64_t bytes = 0;
  auto check = [&](const cpu::KernelWeight& w) {
    ASSERT_TRUE(cpu::IsIntegerDotType(w.view.type));
    ASSERT_NE(w.interleaved, nullptr);
    ASSERT_EQ(w.view.rows % 16, 0);  // SmolLM2: every matrix in whole groups
    bytes += w.view.rows * *gguf::RowBytes(w.view.type, w.view.cols);
  };
  ASSERT_EQ(weights.layers().size(), model_->layers().size());
  for (const cpu::CpuModelWeights::Layer& l : weights.layers()) {
    for (const cpu::KernelWeight* w : {&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down}) {
      ASSERT_NO_FATAL_FAILURE(check(*w));
    }
  }
  ASSERT_NO_FATAL_FAILURE(check(weights.output()));
  EXPECT_EQ(weights.interleaved_bytes(), bytes);  // Q4_1 and Q8_0 keep their size
}

TEST_F(LlamaReferenceTest, GreedyAndLogitsMatchLlamaCpp) {
  auto ref = testing::LoadReference("llamacpp_greedy.json");
  ASSERT_TRUE(ref.ok()) << ref.status();
  const auto& prompts = ref->fields().at("prompts").list_value().values();
  ASSERT_GE(prompts.size(), 4);
  int index = 0;
  for (const auto& p : prompts) {
    const std::string name = p.struct_value().fields().at("name").string_value();
    SCOPED_TRACE(name);
    const testing::GreedyComparison c = testing::CompareWithLlamaCppGreedy(
        *engine_, "ref-" + std::to_string(index++), p.struct_value(), kGreedyTokens, kNearTie, name);
    EXPECT_LE(c.first_step_gap, kLogitTolerance);
  }
}

TEST_F(LlamaReferenceTest, ExactPathMatchesFloat64Reference) {
  auto ref = testing::LoadReference("fp64_reference.json");
  ASSERT_TRUE(ref.ok()) << ref.status();
  auto greedy = testing::LoadReference("llamacpp_greedy.json");
  ASSERT_TRUE(greedy.ok()) << greedy.status();
  Build(kv::KvDtype::kF32);
  const cpu::ScopedSgemmMinTokens exact(1);  // every matmul on dequantised f32 weights
  const auto& prompts = ref->fields().at("prompts").list_value().values();
  const auto& inputs = greedy->fields().at("prompts").list_value().values();
  ASSERT_EQ(prompts.size(), inputs.size());
  for (int i = 0; i < prompts.size(); ++i) {
    const auto& f = prompts[i].struct_value().fields();
    SCOPED_TRACE(f.at("name").string_value());
    const std::string id = "exact-" + std::to_string(i);
    ASSERT_TRUE(kv_->CreateSession(id, "t").ok());
    std::vector<float> logits = Step(id, testing::Ints(inputs[i].struct_value().fields().at("prompt_ids")));
    const std::vector<int32_t> ids = testing::Ints(f.at("top20_ids"));
    const std::vector<float> expected = testing::Floats(f.at("top20_logits"));
    for (size_t j = 0; j < ids.size(); ++j) EXPECT_NEAR(logits[ids[j]], expected[j], 2e-3) << "rank " << j;
    EXPECT_EQ(model::Argmax(logits), ids[0]);
    ASSERT_TRUE(kv_->CloseSession(id).ok());
  }
}

// The serving path's own error: its first-step top-20 logit gaps against the
// float64 forward pass.
TEST_F(LlamaReferenceTest, ServingPathGapsNearFloat64) {
  auto ref = testing::LoadReference("fp64_reference.json");
  ASSERT_TRUE(ref.ok()) << ref.status();
  auto greedy = testing::LoadReference("llamacpp_greedy.json");
  ASSERT_TRUE(greedy.ok()) << greedy.status();
  const auto& prompts = ref->fields().at("prompts").list_value().values();
  const auto& inputs = greedy->fields().at("prompts").list_value().values();
  ASSERT_EQ(prompts.size(), inputs.size());
  for (int i = 0; i < prompts.size(); ++i) {
    const auto& f = prompts[i].struct_value().fields();
    const std::string name = f.at("name").string_value();
    SCOPED_TRACE(name);
    const std::string id = "serving-" + std::to_string(i);
    ASSERT_TRUE(kv_->CreateSession(id, "t").ok());
    std::vector<float> logits = Step(id, testing::Ints(inputs[i].struct_value().fields().at("prompt_ids")));
    const std::vector<int32_t> ids = testing::Ints(f.at("top20_ids"));
    const std::vector<float> expected = testing::Floats(f.at("top20_logits"));
    float worst_gap = 0.0f;
    for (size_t j = 0; j < ids.size(); ++j) {
      worst_gap =
          std::max(worst_gap, std::fabs((logits[ids[j]] - logits[ids[0]]) - (expected[j] - expected[0])));
    }
    std::printf("%-13s serving path vs float64: max gap diff %.3f\n", name.c_str(), worst_gap);
    EXPECT_LE(worst_gap, kServingTolerance);
    ASSERT_TRUE(kv_->CloseSession(id).ok());
  }
}

// How much the chunking of a context changes its logits. The engine splits
// prefill into chunks as the step budget allows, decodes one token a step, and
// recomputes what the KV cache dropped under memory pressure as a prefill: the
// same context can reach the model cut in different ways, and the kernels' float
// rounding differs between one-token steps and larger chunks (README,
// "Exactness"). The difference is printed at the machine's kernel level and
// bounded by the serving path's own error against float64.
TEST_F(LlamaReferenceTest, ChunkingChangesLogitsOnlyByRounding) {
  std::vector<int32_t> context;
  for (int i = 0; i < 120; ++i) context.push_back(100 + (i * 37) % 5000);
  auto run = [&](const std::string& id, const std::vector<int>& chunks) {
    EXPECT_TRUE(kv_->CreateSession(id, "t").ok());
    std::vector<float> logits;
    size_t pos = 0;
    for (int n : chunks) {
      logits = Step(id, std::vector<int32_t>(context.begin() + pos, context.begin() + pos + n));
      pos += n;
    }
    EXPECT_EQ(pos, context.size());
    EXPECT_TRUE(kv_->CloseSession(id).ok());
    return logits;
  };
  const std::vector<float> whole = run("whole", {120});
  std::vector<int> decoded = {112};
  decoded.resize(9, 1);
  const std::vector<std::pair<std::string, std::vector<int>>> cuts = {
      {"60+60", {60, 60}}, {"5+64+51", {5, 64, 51}}, {"112 then 8 single steps", decoded}};
  for (const auto& [name, chunks] : cuts) {
    const std::vector<float> other = run(name, chunks);
    float worst = 0.0f;
    for (size_t i = 0; i < whole.size(); ++i) worst = std::max(worst, std::fabs(whole[i] - other[i]));
    std::printf("kernel level %s: logits of 120 tokens in one chunk vs %s: max |diff| %.3f\n",
                cpu::CpuKernelLevelName(cpu::GetCpuKernelLevel()), name.c_str(), worst);
    EXPECT_LE(worst, kServingTolerance) << name;
  }
}

// Decode steps whose layers run as one group of sequences per thread
// (CpuRunnerOptions::Groups) give every sequence the logits that one loop over
// the whole batch gives, bit for bit, at each vector level (whose integer
// kernels compute a token from that token alone; the scalar level's sgemm
// route rounds by the call's shape, and kAuto never groups there): sequences
// of different lengths (under 512 keys, where attention never cuts a key
// range), an odd count, and a step that mixes decodes with a prompt chunk.
TEST_F(LlamaReferenceTest, DecodeGroupsGiveTheSameLogitsAsOneLoop) {
  const int saved_threads = cpu::NumThreads();
  const cpu::CpuKernelLevel saved_level = cpu::GetCpuKernelLevel();
  cpu::SetNumThreads(2);
  for (cpu::CpuKernelLevel level : cpu::SupportedCpuKernelLevels()) {
    if (level == cpu::CpuKernelLevel::kScalar) continue;
    SCOPED_TRACE(cpu::CpuKernelLevelName(level));
    ASSERT_TRUE(cpu::SetCpuKernelLevel(level).ok());
    struct Engine {
      std::unique_ptr<kv::KvCacheManager> kv;
      std::unique_ptr<cpu::CpuLlamaRunner> runner;
    };
    auto make = [&](cpu::CpuRunnerOptions::Groups groups) {
      Engine e;
      e.kv = std::move(kv::KvCacheManager::Create(testing::ReferenceKvOptions(*model_, kv::KvDtype::kF16)))
                 .value();
      cpu::CpuRunnerOptions o;
      o.max_batch_tokens = 256;
      o.groups = groups;
      e.runner = std::move(cpu::CpuLlamaRunner::Create(model_, e.kv.get(), o)).value();
      return e;
    };
    Engine one = make(cpu::CpuRunnerOptions::Groups::kNever),
           grouped = make(cpu::CpuRunnerOptions::Groups::kAlways);
    constexpr int kSessions = 7;
    // Step s feeds session i tokens[s][i] (empty: not in the step).
    std::vector<std::vector<std::vector<int32_t>>> steps;
    std::vector<std::vector<int32_t>> prompts(kSessions);
    for (int i = 0; i < kSessions; ++i) {
      for (int j = 0; j < 3 + 11 * i; ++j) prompts[i].push_back(200 + (i * 131 + j * 17) % 9000);
    }
    steps.push_back(prompts);
    for (int s = 0; s < 3; ++s) {
      std::vector<std::vector<int32_t>> decode(kSessions);
      for (int i = 0; i < kSessions; ++i) decode[i] = {static_cast<int32_t>(300 + 11 * i + 7 * s)};
      if (s == 1) decode[3] = {41, 42, 43, 44, 45};  // a prompt chunk among the decodes
      steps.push_back(decode);
    }
    for (Engine* e : {&one, &grouped}) {
      for (int i = 0; i < kSessions; ++i)
        ASSERT_TRUE(e->kv->CreateSession("s" + std::to_string(i), "t").ok());
    }
    for (size_t s = 0; s < steps.size(); ++s) {
      SCOPED_TRACE(::testing::Message() << "step " << s);
      std::vector<float> logits[2];
      int idx = 0;
      for (Engine* e : {&one, &grouped}) {
        std::vector<kv::StepReservation> reservations;  // own the page tables
        for (int i = 0; i < kSessions; ++i) {
          auto res = e->kv->BeginStep("s" + std::to_string(i), static_cast<int64_t>(steps[s][i].size()));
          ASSERT_TRUE(res.ok()) << res.status();
          reservations.push_back(*std::move(res));
        }
        std::vector<model::SequenceStep> batch;
        for (int i = 0; i < kSessions; ++i) {
          model::SequenceStep st;
          st.tokens = steps[s][i];
          st.first_pos = reservations[i].first_pos;
          st.page_table = reservations[i].page_table;
          st.want_logits = true;
          batch.push_back(st);
        }
        if (e == &grouped) {
          // Groups in this test: contiguous, every sequence in one of them.
          const std::vector<size_t> bounds = e->runner->PlanGroups(batch);
          ASSERT_EQ(bounds.size(), 3u);
          EXPECT_EQ(bounds.front(), 0u);
          EXPECT_LT(0u, bounds[1]);
          EXPECT_LT(bounds[1], batch.size());
          EXPECT_EQ(bounds.back(), batch.size());
        } else {
          EXPECT_TRUE(e->runner->PlanGroups(batch).empty());
        }
        const absl::Status st = e->runner->Forward(batch, &logits[idx++]);
        ASSERT_TRUE(st.ok()) << st;
        for (int i = 0; i < kSessions; ++i) {
          ASSERT_TRUE(e->kv->CommitStep("s" + std::to_string(i), steps[s][i]).ok());
        }
      }
      ASSERT_EQ(logits[0].size(), logits[1].size());
      for (size_t j = 0; j < logits[0].size(); ++j) {
        ASSERT_EQ(absl::bit_cast<uint32_t>(logits[0][j]), absl::bit_cast<uint32_t>(logits[1][j]))
            << "sequence " << j / model_->hparams().n_vocab;
      }
    }
  }
  ASSERT_TRUE(cpu::SetCpuKernelLevel(saved_level).ok());
  cpu::SetNumThreads(saved_threads);
}

// A step whose products are split over the threads reports how long its products
// and its attention took, parts of the Forward's wall time; one run as groups
// (whose parts overlap on several threads) reports neither.
TEST_F(LlamaReferenceTest, ForwardProfileSplitsOnlyAStepSplitByRows) {
  const int saved_threads = cpu::NumThreads();
  cpu::SetNumThreads(2);
  for (auto groups : {cpu::CpuRunnerOptions::Groups::kNever, cpu::CpuRunnerOptions::Groups::kAlways}) {
    auto kv = std::move(kv::KvCacheManager::Create(testing::ReferenceKvOptions(*model_, kv::KvDtype::kF16)))
                  .value();
    cpu::CpuRunnerOptions o;
    o.max_batch_tokens = 64;
    o.groups = groups;
    auto runner = std::move(cpu::CpuLlamaRunner::Create(model_, kv.get(), o)).value();
    const std::vector<int32_t> prompt = {200, 300, 400, 500, 600};
    std::vector<kv::StepReservation> reservations;
    std::vector<model::SequenceStep> batch;
    for (const char* id : {"a", "b"}) {
      ASSERT_TRUE(kv->CreateSession(id, "t").ok());
      auto res = kv->BeginStep(id, static_cast<int64_t>(prompt.size()));
      ASSERT_TRUE(res.ok()) << res.status();
      reservations.push_back(*std::move(res));
    }
    for (const kv::StepReservation& r : reservations) {
      model::SequenceStep st;
      st.tokens = prompt;
      st.first_pos = r.first_pos;
      st.page_table = r.page_table;
      st.want_logits = true;
      batch.push_back(st);
    }
    const bool grouped = !runner->PlanGroups(batch).empty();
    ASSERT_EQ(grouped, groups == cpu::CpuRunnerOptions::Groups::kAlways);
    std::vector<float> logits;
    for (int run = 0; run < 2; ++run) {  // the second reports itself, not both
      const auto start = std::chrono::steady_clock::now();
      ASSERT_TRUE(runner->Forward(batch, &logits).ok());
      const absl::Duration wall = absl::FromChrono(std::chrono::steady_clock::now() - start);
      const model::ModelRunner::ForwardProfile p = runner->last_forward_profile();
      if (grouped) {
        EXPECT_EQ(p.products, absl::ZeroDuration());
        EXPECT_EQ(p.attention, absl::ZeroDuration());
      } else {
        EXPECT_GT(p.products, absl::ZeroDuration());
        EXPECT_GT(p.attention, absl::ZeroDuration());
        EXPECT_LE(p.products + p.attention, wall);
      }
    }
  }
  cpu::SetNumThreads(saved_threads);
}

// What the default (kAuto) never groups, on any machine: a step of fewer
// sequences than threads, one thread, and groups beyond the token count that
// the kernels read the weights straight for (a prompt chunk).
TEST_F(LlamaReferenceTest, DecodeGroupsOnlyWhereTheyCanPay) {
  const int saved_threads = cpu::NumThreads();
  auto kv =
      std::move(kv::KvCacheManager::Create(testing::ReferenceKvOptions(*model_, kv::KvDtype::kF16))).value();
  auto runner = std::move(cpu::CpuLlamaRunner::Create(model_, kv.get(), {256, 0})).value();
  const std::vector<int32_t> table(8, 0), tokens(64, 7);
  auto step = [&](int n_tokens) {
    model::SequenceStep s;
    s.tokens = absl::MakeConstSpan(tokens).subspan(0, n_tokens);
    s.first_pos = 10;
    s.page_table = table;
    return s;
  };
  cpu::SetNumThreads(2);
  EXPECT_TRUE(runner->PlanGroups({step(1)}).empty());
  EXPECT_TRUE(runner->PlanGroups({step(64), step(64)}).empty());
  std::vector<model::SequenceStep> decodes(4, step(1));
  EXPECT_TRUE(runner->PlanGroups(decodes).empty());  // 2 tokens a group: no whole tile
  cpu::SetNumThreads(1);
  decodes.assign(16, step(1));
  EXPECT_TRUE(runner->PlanGroups(decodes).empty());
  cpu::SetNumThreads(saved_threads);
}

}  // namespace
}  // namespace kvcache
