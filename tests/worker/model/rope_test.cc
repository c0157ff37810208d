// The model's RoPE (worker/model/rope.h) against the formulas written out: plain,
// linear scaling, Llama 3.1 frequency factors, YaRN's ramp and magnitude, and
// what RopeParamsFor takes from the hyper-parameters. (That llama.cpp computes
// the same is arch_reference_test's job, on a tiny YaRN model.)
#include "worker/model/rope.h"

#include <cmath>

#include "gtest/gtest.h"

namespace kvcache::model {
namespace {

double Theta(int pos, int pair, int d, double base) { return pos * std::pow(base, -2.0 * pair / d); }

TEST(RopeTest, PlainLinearAndFrequencyFactors) {
  RopeParams p;
  p.head_dim = 16;
  p.freq_base = 10000.0f;
  for (int pos : {0, 1, 7, 1000}) {
    for (int i = 0; i < 8; ++i) {
      const RopeAngle a = RopeAt(p, pos, i);
      EXPECT_DOUBLE_EQ(a.cos, std::cos(Theta(pos, i, 16, 1e4)));
      EXPECT_DOUBLE_EQ(a.sin, std::sin(Theta(pos, i, 16, 1e4)));
    }
  }
  p.freq_scale = 0.25f;  // linear, factor 4
  p.freq_factors = {1, 2, 3, 4, 5, 6, 7, 8};
  for (int i = 0; i < 8; ++i) {
    EXPECT_NEAR(RopeAt(p, 100, i).cos, std::cos(0.25 * Theta(100, i, 16, 1e4) / (i + 1)), 1e-12);
  }
  p.attn_factor = 0.5f;  // rope.scaling.attn_factor scales both
  EXPECT_NEAR(RopeAt(p, 100, 3).sin, 0.5 * std::sin(0.25 * Theta(100, 3, 16, 1e4) / 4), 1e-12);
}

TEST(RopeTest, YarnRampsBetweenExtrapolationAndInterpolation) {
  RopeParams p;
  p.head_dim = 16;
  p.freq_base = 10000.0f;
  p.freq_scale = 0.25f;  // factor 4
  p.yarn = true;
  p.yarn_orig_ctx = 32;
  // Correction dims: floor(16 ln(32 / (32 * 2 pi)) / (2 ln 1e4)) -> 0 and
  // ceil(16 ln(32 / (1 * 2 pi)) / (2 ln 1e4)) = ceil(1.41) = 2: pair 0 keeps
  // the original angle, pair 1 is halfway, pairs 2.. are interpolated.
  const double mag = 1.0 + 0.1 * std::log(4.0);
  const int pos = 11;
  auto expect = [&](int i, double theta) {
    EXPECT_NEAR(RopeAt(p, pos, i).cos, mag * std::cos(theta), 1e-12) << "pair " << i;
    EXPECT_NEAR(RopeAt(p, pos, i).sin, mag * std::sin(theta), 1e-12) << "pair " << i;
  };
  expect(0, Theta(pos, 0, 16, 1e4));
  expect(1, 0.5 * Theta(pos, 1, 16, 1e4) + 0.5 * 0.25 * Theta(pos, 1, 16, 1e4));
  for (int i = 2; i < 8; ++i) expect(i, 0.25 * Theta(pos, i, 16, 1e4));
}

TEST(RopeTest, ParamsFromHyperparameters) {
  gguf::LlamaHparams hp;
  hp.head_dim = 128;
  hp.rope_freq_base = 1e6;
  hp.n_ctx_train = 32768;
  hp.rope_neox = true;
  auto plain = RopeParamsFor(hp, {});
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_FALSE(plain->yarn);
  EXPECT_EQ(plain->freq_scale, 1.0f);
  EXPECT_TRUE(plain->neox);
  EXPECT_EQ(RopeMaxPositions(hp), 32768);

  hp.rope_scaling.type = "yarn";  // Qwen 2.5 / Qwen 3 at 128k
  hp.rope_scaling.factor = 4.0;
  hp.rope_scaling.original_context_length = 32768;
  auto yarn = RopeParamsFor(hp, {});
  ASSERT_TRUE(yarn.ok()) << yarn.status();
  EXPECT_TRUE(yarn->yarn);
  EXPECT_EQ(yarn->freq_scale, 0.25f);
  EXPECT_EQ(yarn->yarn_orig_ctx, 32768);
  EXPECT_EQ(RopeMaxPositions(hp), 131072);
  hp.rope_scaling.original_context_length = 0;  // falls back to context_length
  EXPECT_EQ(RopeParamsFor(hp, {})->yarn_orig_ctx, 32768);

  hp.rope_scaling.type = "longrope";
  auto other = RopeParamsFor(hp, {});
  EXPECT_EQ(other.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_NE(other.status().message().find("longrope"), absl::string_view::npos);
}

}  // namespace
}  // namespace kvcache::model
