// Test helper: the CPU runner on a real model, and the teacher-forced
// comparison of its greedy decisions with llama.cpp's recorded ones
// (tests/data/llamacpp_greedy.json, tests/data/requant_reference.json).
//
// Thread-safety: a ReferenceEngine is used by one test thread.
#ifndef KVCACHE_TESTS_WORKER_MODEL_GREEDY_REFERENCE_H_
#define KVCACHE_TESTS_WORKER_MODEL_GREEDY_REFERENCE_H_

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "google/protobuf/struct.pb.h"
#include "gtest/gtest.h"
#include "tests/common/gguf/reference_data.h"
#include "worker/backend/cpu/cpu_llama_runner.h"
#include "worker/backend/cpu/matmul.h"
#include "worker/kv/kv_cache_manager.h"
#include "worker/model/llama_model.h"
#include "worker/model/model_runner.h"
#include "worker/model/sampler.h"

namespace kvcache {
namespace testing {

// The options of a KV cache of 64 pages of 16 tokens for `model`.
inline kv::KvCacheOptions ReferenceKvOptions(const model::LlamaModel& model, kv::KvDtype dtype) {
  const auto& hp = model.hparams();
  kv::KvCacheOptions ko;
  ko.shape = kv::KvShape{static_cast<int>(hp.n_layer),
                         static_cast<int>(hp.n_head_kv),
                         static_cast<int>(hp.head_dim),
                         dtype,
                         16,
                         0};
  ko.model_id = model.model_id();
  ko.tier0_bytes = 64 * ko.shape.page_bytes();
  return ko;
}

// A KV cache (ReferenceKvOptions) and a runner over a model: by default the CPU
// runner. An exact-math CPU engine keeps f32 K/V and runs every matmul on
// dequantised f32 weights (no 8-bit activation blocks): on the Q4_1 model its
// logits equal a float64 forward pass within 2e-3 (llama_reference_test).
class ReferenceEngine {
 public:
  enum class Math { kServing, kExact };

  ReferenceEngine(const model::LlamaModel* model, kv::KvDtype dtype, Math math = Math::kServing)
      : math_(math) {
    auto kv = kv::KvCacheManager::Create(ReferenceKvOptions(*model, dtype));
    EXPECT_TRUE(kv.ok()) << kv.status();
    if (!kv.ok()) return;
    kv_ = std::move(*kv);
    auto r = cpu::CpuLlamaRunner::Create(model, kv_.get(), {256, 0});
    EXPECT_TRUE(r.ok()) << r.status();
    if (r.ok()) runner_ = std::move(*r);
  }
  // Another backend's runner over `kv` (e.g. the CUDA runner with tier 0 on the
  // device); serving math.
  ReferenceEngine(std::unique_ptr<kv::KvCacheManager> kv, model::ModelRunnerPtr runner)
      : math_(Math::kServing), kv_(std::move(kv)), runner_(std::move(runner)) {}

  bool ok() const { return runner_ != nullptr; }
  kv::KvCacheManager* kv() { return kv_.get(); }

  // Runs `tokens` through session `id` in one step and returns the logits.
  std::vector<float> Step(const std::string& id, const std::vector<int32_t>& tokens) {
    auto res = kv_->BeginStep(id, static_cast<int64_t>(tokens.size()));
    EXPECT_TRUE(res.ok()) << res.status();
    if (!res.ok()) return {};
    model::SequenceStep s;
    s.tokens = tokens;
    s.first_pos = res->first_pos;
    s.page_table = res->page_table;
    s.want_logits = true;
    std::vector<float> logits;
    std::optional<cpu::ScopedSgemmMinTokens> exact;  // every matmul on dequantised f32 weights
    if (math_ == Math::kExact) exact.emplace(1);
    absl::Status st = runner_->Forward({s}, &logits);
    EXPECT_TRUE(st.ok()) << st;
    EXPECT_TRUE(kv_->CommitStep(id, tokens).ok());
    return logits;
  }

 private:
  const Math math_;
  std::unique_ptr<kv::KvCacheManager> kv_;
  model::ModelRunnerPtr runner_;
};

// How our decisions compared with llama.cpp's on one prompt.
struct GreedyComparison {
  float first_step_abs = 0;  // max |logit - llama.cpp's| over its first-step top 20
  float first_step_gap = 0;  // max |(logit - top logit) - llama.cpp's| over the same
  float margin = 0;          // max |our top-2 margin - llama.cpp's| along its path
  int decided = 0;           // steps whose llama.cpp margin is at least near_tie
  int agree = 0;             // of those, steps where our argmax is llama.cpp's token
  int ties = 0;              // steps below near_tie: decided by rounding, counted only
  int tie_agree = 0;
  // With an exact-math engine: decided steps where we differ from llama.cpp and
  // exact math calls it a tie (|margin| < exact_tie: llama.cpp's rounding
  // decided them), and the squared errors of both engines' margins
  // against exact math, summed over `steps` steps.
  int arbitrated = 0;
  int steps = 0;
  double ours_sq = 0, llamacpp_sq = 0;
};

// The top-1 minus top-2 logit when `token` is the top, else negative: how far
// `token` leads every other token.
inline float LeadOf(const std::vector<float>& logits, int32_t token) {
  float runner_up = -1e30f;
  for (size_t v = 0; v < logits.size(); ++v) {
    if (static_cast<int32_t>(v) != token) runner_up = std::max(runner_up, logits[v]);
  }
  return logits[token] - runner_up;
}

// Teacher-forces llama.cpp's greedy tokens of one recorded prompt (fields
// prompt_ids, generated_ids, margins, first_step.top20_ids/top20_logits)
// through session `id` for up to `max_steps` steps. EXPECTs our argmax to be
// llama.cpp's token at every step whose llama.cpp top-2 margin is at least
// `near_tie`. With `exact` (an exact-math engine over the same model), such a
// step may differ only when exact math calls it a tie: llama.cpp's token less
// than `exact_tie` ahead of or behind the best other token (two roundings of a
// near-tie, and llama.cpp's was the further from exact there). Prints one line
// prefixed with `label`.
inline GreedyComparison CompareWithLlamaCppGreedy(ReferenceEngine& engine, const std::string& id,
                                                  const google::protobuf::Struct& prompt, int max_steps,
                                                  float near_tie, const std::string& label,
                                                  ReferenceEngine* exact = nullptr, float exact_tie = 0) {
  const auto& f = prompt.fields();
  const std::vector<int32_t> expected = Ints(f.at("generated_ids"));
  const std::vector<float> margins = Floats(f.at("margins"));
  const std::vector<int32_t> prompt_ids = Ints(f.at("prompt_ids"));
  GreedyComparison c;
  EXPECT_TRUE(engine.kv()->CreateSession(id, "t").ok());
  if (exact != nullptr) {
    EXPECT_TRUE(exact->kv()->CreateSession(id, "t").ok());
  }
  std::vector<float> logits = engine.Step(id, prompt_ids);
  std::vector<float> exact_logits = exact != nullptr ? exact->Step(id, prompt_ids) : std::vector<float>();
  if (logits.empty() || (exact != nullptr && exact_logits.empty())) return c;
  const auto& first = f.at("first_step").struct_value().fields();
  const std::vector<int32_t> top_ids = Ints(first.at("top20_ids"));
  const std::vector<float> top_logits = Floats(first.at("top20_logits"));
  for (size_t i = 0; i < top_ids.size(); ++i) {
    c.first_step_abs = std::max(c.first_step_abs, std::fabs(logits[top_ids[i]] - top_logits[i]));
    const float ours = logits[top_ids[i]] - logits[top_ids[0]];
    c.first_step_gap = std::max(c.first_step_gap, std::fabs(ours - (top_logits[i] - top_logits[0])));
  }
  const int n = std::min<int>(max_steps, static_cast<int>(expected.size()));
  for (int i = 0; i < n; ++i) {
    const int32_t ours = model::Argmax(logits);
    const float our_margin = LeadOf(logits, expected[i]);  // < 0 when we disagree
    c.margin = std::max(c.margin, std::fabs(our_margin - margins[i]));
    float exact_margin = 0;
    if (exact != nullptr) {
      exact_margin = LeadOf(exact_logits, expected[i]);
      c.ours_sq += (our_margin - exact_margin) * (our_margin - exact_margin);
      c.llamacpp_sq += (margins[i] - exact_margin) * (margins[i] - exact_margin);
      ++c.steps;
    }
    if (margins[i] < near_tie) {
      ++c.ties;
      c.tie_agree += ours == expected[i];
    } else {
      ++c.decided;
      c.agree += ours == expected[i];
      if (ours != expected[i] && exact != nullptr && std::fabs(exact_margin) < exact_tie) {
        ++c.arbitrated;
        std::printf(
            "%s step %d: llama.cpp's token leads by %.3f there, by %.3f in ours, by %.3f in exact math\n",
            label.c_str(), i, margins[i], our_margin, exact_margin);
      } else {
        EXPECT_EQ(ours, expected[i]) << label << " step " << i << ", llama.cpp margin " << margins[i]
                                     << (exact != nullptr ? ", exact-math margin " : "")
                                     << (exact != nullptr ? std::to_string(exact_margin) : "");
      }
    }
    if (i + 1 < n) {
      logits = engine.Step(id, {expected[i]});
      if (exact != nullptr) exact_logits = exact->Step(id, {expected[i]});
    }
  }
  EXPECT_TRUE(engine.kv()->CloseSession(id).ok());
  if (exact != nullptr) {
    EXPECT_TRUE(exact->kv()->CloseSession(id).ok());
  }
  std::printf(
      "%-22s first step: max |logit diff| %.3f, max gap diff %.3f; %d/%d decisions equal, "
      "%d/%d near-ties equal, max margin diff %.3f\n",
      label.c_str(), c.first_step_abs, c.first_step_gap, c.agree, c.decided, c.tie_agree, c.ties, c.margin);
  return c;
}

}  // namespace testing
}  // namespace kvcache

#endif  // KVCACHE_TESTS_WORKER_MODEL_GREEDY_REFERENCE_H_
