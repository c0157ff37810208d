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
#include <cmath>

#include "common/gguf/model_path.h"
#include "gtest/gtest.h"
#include "tests/common/gguf/reference_data.h"
#include "worker/backend/cpu/cpu_features.h"
#include "worker/backend/cpu/cpu_llama_runner.h"
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
    runner_.reset();
    const auto& hp = model_->hparams();
    kv::KvCacheOptions ko;
    ko.shape = kv::KvShape{static_cast<int>(hp.n_layer),
                           static_cast<int>(hp.n_head_kv),
                           static_cast<int>(hp.head_dim),
                           dtype,
                           16,
                           0};
    ko.model_id = model_->model_id();
    ko.tier0_bytes = 64 * ko.shape.page_bytes();
    auto kv = kv::KvCacheManager::Create(ko);
    ASSERT_TRUE(kv.ok()) << kv.status();
    kv_ = std::move(*kv);
    auto r = cpu::CpuLlamaRunner::Create(model_, kv_.get(), {256, 0});
    ASSERT_TRUE(r.ok()) << r.status();
    runner_ = std::move(*r);
  }

  // Runs `tokens` through session `id` in one step and returns the logits.
  std::vector<float> Step(const std::string& id, const std::vector<int32_t>& tokens) {
    auto res = kv_->BeginStep(id, static_cast<int64_t>(tokens.size()));
    EXPECT_TRUE(res.ok()) << res.status();
    model::SequenceStep s;
    s.tokens = tokens;
    s.first_pos = res->first_pos;
    s.page_table = res->page_table;
    s.want_logits = true;
    std::vector<float> logits;
    absl::Status st = runner_->Forward({s}, &logits);
    EXPECT_TRUE(st.ok()) << st;
    EXPECT_TRUE(kv_->CommitStep(id, tokens).ok());
    return logits;
  }

  static model::LlamaModel* model_;
  std::unique_ptr<kv::KvCacheManager> kv_;
  std::unique_ptr<cpu::CpuLlamaRunner> runner_;
};

model::LlamaModel* LlamaReferenceTest::model_ = nullptr;

TEST_F(LlamaReferenceTest, GreedyAndLogitsMatchLlamaCpp) {
  auto ref = testing::LoadReference("llamacpp_greedy.json");
  ASSERT_TRUE(ref.ok()) << ref.status();
  const auto& prompts = ref->fields().at("prompts").list_value().values();
  ASSERT_GE(prompts.size(), 4);
  int index = 0;
  for (const auto& p : prompts) {
    const auto& f = p.struct_value().fields();
    const std::string name = f.at("name").string_value();
    SCOPED_TRACE(name);
    const std::vector<int32_t> prompt = testing::Ints(f.at("prompt_ids"));
    const std::vector<int32_t> expected = testing::Ints(f.at("generated_ids"));
    const std::vector<float> margins = testing::Floats(f.at("margins"));
    const std::string id = "ref-" + std::to_string(index++);
    ASSERT_TRUE(kv_->CreateSession(id, "t").ok());

    std::vector<float> logits = Step(id, prompt);
    const auto& first = f.at("first_step").struct_value().fields();
    const std::vector<int32_t> top_ids = testing::Ints(first.at("top20_ids"));
    const std::vector<float> top_logits = testing::Floats(first.at("top20_logits"));
    float worst_abs = 0, worst_gap = 0;
    for (size_t i = 0; i < top_ids.size(); ++i) {
      worst_abs = std::max(worst_abs, std::fabs(logits[top_ids[i]] - top_logits[i]));
      const float ours = logits[top_ids[i]] - logits[top_ids[0]];
      const float theirs = top_logits[i] - top_logits[0];
      worst_gap = std::max(worst_gap, std::fabs(ours - theirs));
    }
    // Teacher-forced: feed llama.cpp's token each step and compare decisions.
    const int n = std::min<int>(kGreedyTokens, static_cast<int>(expected.size()));
    int agree = 0, ties = 0, tie_agree = 0;
    float worst_margin = 0;
    for (int i = 0; i < n; ++i) {
      const int32_t ours = model::Argmax(logits);
      const float their_margin = margins[i];
      float runner_up = -1e30f;
      for (size_t v = 0; v < logits.size(); ++v) {
        if (static_cast<int32_t>(v) != expected[i]) runner_up = std::max(runner_up, logits[v]);
      }
      const float our_margin = logits[expected[i]] - runner_up;  // < 0 when we disagree
      worst_margin = std::max(worst_margin, std::fabs(our_margin - their_margin));
      if (their_margin < kNearTie) {
        ++ties;
        tie_agree += ours == expected[i];
      } else {
        EXPECT_EQ(ours, expected[i]) << "step " << i << ", llama.cpp margin " << their_margin;
        agree += ours == expected[i];
      }
      if (i + 1 < n) logits = Step(id, {expected[i]});
    }
    std::printf(
        "%-13s first step: max |logit diff| %.3f, max gap diff %.3f; %d/%d decisions equal, "
        "%d/%d near-ties equal, max margin diff %.3f\n",
        name.c_str(), worst_abs, worst_gap, agree, n - ties, tie_agree, ties, worst_margin);
    EXPECT_LE(worst_gap, kLogitTolerance);
    ASSERT_TRUE(kv_->CloseSession(id).ok());
  }
}

TEST_F(LlamaReferenceTest, ExactPathMatchesFloat64Reference) {
  auto ref = testing::LoadReference("fp64_reference.json");
  ASSERT_TRUE(ref.ok()) << ref.status();
  auto greedy = testing::LoadReference("llamacpp_greedy.json");
  ASSERT_TRUE(greedy.ok()) << greedy.status();
  Build(kv::KvDtype::kF32);
  const int saved = cpu::SgemmMinTokens();
  cpu::SetSgemmMinTokens(1);  // every matmul on dequantised f32 weights
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
  cpu::SetSgemmMinTokens(saved);
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

}  // namespace
}  // namespace kvcache
