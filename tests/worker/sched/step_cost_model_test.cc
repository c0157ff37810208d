#include "worker/sched/step_cost_model.h"

#include <random>

#include "gtest/gtest.h"

namespace kvcache::sched {
namespace {

// A machine whose steps cost 2 ms + 0.5 ms per decode + 1 µs per decode context
// token + 0.2 ms per prefill token + 10 ns per prefill attention pair.
absl::Duration TrueCost(const StepShape& s) {
  return absl::Microseconds(2000 + 500 * s.decode_tokens + s.decode_context + 200 * s.prefill_tokens) +
         absl::Nanoseconds(10 * s.prefill_attention);
}

StepShape RandomShape(std::mt19937& rng) {
  StepShape s;
  s.decode_tokens = std::uniform_int_distribution<int>(0, 16)(rng);
  s.decode_context = s.decode_tokens * std::uniform_int_distribution<int>(50, 4000)(rng);
  s.prefill_tokens = std::uniform_int_distribution<int>(0, 1)(rng) != 0
                         ? std::uniform_int_distribution<int>(1, 256)(rng)
                         : 0;
  const int pos = std::uniform_int_distribution<int>(0, 4000)(rng);
  s.prefill_attention = static_cast<double>(s.prefill_tokens) * (pos + s.prefill_tokens / 2.0);
  return s;
}

TEST(StepCostModelTest, LearnsALinearMachineFromItsSteps) {
  StepCostModel m;
  EXPECT_FALSE(m.ready());
  std::mt19937 rng(7);
  for (int i = 0; i < 200; ++i) {
    const StepShape s = RandomShape(rng);
    // 2% multiplicative noise, as a shared machine has.
    const double noise = std::uniform_real_distribution<double>(0.98, 1.02)(rng);
    m.Observe(s, TrueCost(s) * noise);
  }
  ASSERT_TRUE(m.ready());
  for (int i = 0; i < 50; ++i) {
    const StepShape s = RandomShape(rng);
    const double want = absl::ToDoubleSeconds(TrueCost(s));
    EXPECT_NEAR(absl::ToDoubleSeconds(m.Predict(s)), want, 0.05 * want);
  }
  EXPECT_NEAR(m.PrefillTokenSeconds(0), 200e-6, 20e-6);
  EXPECT_NEAR(m.PrefillTokenSeconds(4000), 200e-6 + 4000 * 10e-9, 20e-6);
}

// A fresh worker: its first prompt runs in prefill-only chunks, its answer in
// decode-only steps. That is enough to bound the first step that mixes them,
// which would otherwise run a whole chunk beside the decodes.
TEST(StepCostModelTest, PrefillOnlyAndDecodeOnlyStepsPredictMixedSteps) {
  StepCostModel m;
  int64_t pos = 0;
  for (int chunk = 0; chunk < 7; ++chunk) {
    StepShape s;
    s.prefill_tokens = chunk < 6 ? 256 : 152;
    s.prefill_attention = static_cast<double>(s.prefill_tokens) * (pos + s.prefill_tokens / 2.0);
    pos += s.prefill_tokens;
    m.Observe(s, TrueCost(s));
  }
  EXPECT_FALSE(m.ready());  // no decode yet
  for (int i = 0; i < 32; ++i) {
    StepShape s;
    s.decode_tokens = 1;
    s.decode_context = pos++;
    m.Observe(s, TrueCost(s));
  }
  ASSERT_TRUE(m.ready());
  StepShape mixed;
  mixed.decode_tokens = 1;
  mixed.decode_context = 1800;
  mixed.prefill_tokens = 128;
  mixed.prefill_attention = 128 * (416 + 64.0);
  const double want = absl::ToDoubleSeconds(TrueCost(mixed));
  EXPECT_NEAR(absl::ToDoubleSeconds(m.Predict(mixed)), want, 0.15 * want);
  EXPECT_NEAR(m.PrefillTokenSeconds(416), 200e-6 + 416 * 10e-9, 40e-6);
}

TEST(StepCostModelTest, FollowsAMachineThatSlowsDown) {
  StepCostModel m;
  std::mt19937 rng(3);
  for (int i = 0; i < 200; ++i) {
    const StepShape s = RandomShape(rng);
    m.Observe(s, TrueCost(s));
  }
  for (int i = 0; i < 400; ++i) {  // another process now takes half the machine
    const StepShape s = RandomShape(rng);
    m.Observe(s, 2 * TrueCost(s));
  }
  EXPECT_NEAR(m.PrefillTokenSeconds(0), 400e-6, 40e-6);
}

TEST(StepCostModelTest, CorrelatedFeaturesGetNoNegativeCosts) {
  // Every decoding stream has about 2,000 tokens of context, so decodes and
  // their context move together; plain least squares may then fit one of the
  // two with a negative cost. The fit must stay non-negative and predictive.
  StepCostModel m;
  std::mt19937 rng(5);
  for (int i = 0; i < 300; ++i) {
    StepShape s;
    s.decode_tokens = std::uniform_int_distribution<int>(1, 6)(rng);
    s.decode_context = s.decode_tokens * std::uniform_int_distribution<int>(1990, 2010)(rng);
    if (i % 2 == 0) {
      s.prefill_tokens = 16 * std::uniform_int_distribution<int>(1, 4)(rng);
      s.prefill_attention = static_cast<double>(s.prefill_tokens) * 1000;
    }
    const double noise = std::uniform_real_distribution<double>(0.9, 1.1)(rng);
    m.Observe(s, TrueCost(s) * noise);
  }
  for (double c : m.coefficients()) EXPECT_GE(c, 0);
  const StepShape probe{4, 8000, 32, 32000};
  const double want = absl::ToDoubleSeconds(TrueCost(probe));
  EXPECT_NEAR(absl::ToDoubleSeconds(m.Predict(probe)), want, 0.15 * want);
}

TEST(StepCostModelTest, NeverPredictsNegativeTimes) {
  StepCostModel m;
  m.Observe(StepShape{1, 100, 0, 0}, absl::Milliseconds(5));
  EXPECT_GE(m.Predict(StepShape{}), absl::ZeroDuration());
  EXPECT_GT(m.PrefillTokenSeconds(0), 0);
}

}  // namespace
}  // namespace kvcache::sched
