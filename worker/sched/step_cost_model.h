// StepCostModel: what an engine step costs, learnt from the runner's own step
// timings, so that the scheduler can size prefill chunks to a step-time target
// (the Sarathi-Serve idea: decodes run every step, and prefill fills the rest of a
// step whose length bounds inter-token latency).
//
// A step's duration is modelled as a linear function of what it computes:
//
//   t = c0 + c1 * decode_tokens + c2 * decode_context + c3 * prefill_tokens
//         + c4 * prefill_attention
//
// decode_context is the sum of the decoding sequences' context lengths (their
// attention reads), prefill_attention the sum over prefill chunks of
// n * (first_pos + n / 2) (the keys each new token attends to). The coefficients are
// fitted by non-negative least squares over recent steps, older steps weighing
// exponentially less, so the model follows a machine whose speed changes (other
// load, thermal), and correlated features (decodes and their context) cannot
// cancel each other out with coefficients of opposite signs.
//
// Thread-compatible: the engine thread owns it.
#ifndef KVCACHE_WORKER_SCHED_STEP_COST_MODEL_H_
#define KVCACHE_WORKER_SCHED_STEP_COST_MODEL_H_

#include <array>
#include <cstdint>

#include "absl/time/time.h"

namespace kvcache::sched {

struct StepShape {
  int64_t decode_tokens = 0;
  int64_t decode_context = 0;
  int64_t prefill_tokens = 0;
  double prefill_attention = 0;
};

class StepCostModel {
 public:
  static constexpr int kFeatures = 5;

  // `forget`: the weight of the previous steps after each new one, in (0, 1].
  explicit StepCostModel(double forget = 0.98);

  void Observe(const StepShape& shape, absl::Duration took);
  // True once enough steps with decodes and enough with prefill were seen for
  // every term to mean something. They need not be the same steps: the model
  // is additive, so a fresh worker's first prompt (prefill-only chunks) and
  // first answer (decode-only steps) already bound its first mixed steps.
  bool ready() const { return prefill_steps_ >= kMinSteps && decode_steps_ >= kMinSteps; }
  // Predicted duration (never negative).
  absl::Duration Predict(const StepShape& shape) const;
  // Seconds that one more prefill token at position `pos` adds (at least a floor
  // of 1 µs, so that budgets stay finite).
  double PrefillTokenSeconds(int64_t pos) const;
  // The fitted coefficients (seconds per unit of each feature), for logs and tests.
  const std::array<double, kFeatures>& coefficients() const { return coef_; }

 private:
  static constexpr int kMinSteps = 4;
  static std::array<double, kFeatures> Features(const StepShape& shape);
  void Solve();

  const double forget_;
  std::array<std::array<double, kFeatures>, kFeatures> xtx_{};
  std::array<double, kFeatures> xty_{};
  std::array<double, kFeatures> coef_{};
  int64_t prefill_steps_ = 0;
  int64_t decode_steps_ = 0;
};

}  // namespace kvcache::sched

#endif  // KVCACHE_WORKER_SCHED_STEP_COST_MODEL_H_
