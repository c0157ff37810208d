#include "worker/sched/step_cost_model.h"

#include <algorithm>
#include <cmath>

namespace kvcache::sched {
namespace {

// Features are scaled to comparable magnitudes (tokens, thousands of context
// tokens, millions of attention pairs) so that the normal equations stay well
// conditioned.
constexpr double kContextScale = 1e-3;
constexpr double kAttentionScale = 1e-6;
constexpr double kMinTokenSeconds = 1e-6;

}  // namespace

StepCostModel::StepCostModel(double forget) : forget_(std::clamp(forget, 0.5, 1.0)) {}

std::array<double, StepCostModel::kFeatures> StepCostModel::Features(const StepShape& shape) {
  return {1.0, static_cast<double>(shape.decode_tokens),
          static_cast<double>(shape.decode_context) * kContextScale,
          static_cast<double>(shape.prefill_tokens), shape.prefill_attention * kAttentionScale};
}

void StepCostModel::Observe(const StepShape& shape, absl::Duration took) {
  const auto x = Features(shape);
  const double y = absl::ToDoubleSeconds(took);
  for (int i = 0; i < kFeatures; ++i) {
    for (int j = 0; j < kFeatures; ++j) xtx_[i][j] = forget_ * xtx_[i][j] + x[i] * x[j];
    xty_[i] = forget_ * xty_[i] + x[i] * y;
  }
  if (shape.prefill_tokens > 0 && shape.decode_tokens > 0) ++mixed_steps_;
  if (shape.decode_tokens > 0) ++decode_steps_;
  Solve();
}

void StepCostModel::Solve() {
  // Ridge-regularised normal equations, Gaussian elimination with partial pivoting.
  // The small ridge keeps features the recent steps never varied (say, no prefill
  // at all) at zero instead of making the system singular.
  double trace = 0;
  for (int i = 0; i < kFeatures; ++i) trace += xtx_[i][i];
  const double ridge = 1e-9 * std::max(trace, 1.0);
  std::array<std::array<double, kFeatures + 1>, kFeatures> a{};
  for (int i = 0; i < kFeatures; ++i) {
    for (int j = 0; j < kFeatures; ++j) a[i][j] = xtx_[i][j] + (i == j ? ridge : 0.0);
    a[i][kFeatures] = xty_[i];
  }
  for (int col = 0; col < kFeatures; ++col) {
    int pivot = col;
    for (int r = col + 1; r < kFeatures; ++r) {
      if (std::fabs(a[r][col]) > std::fabs(a[pivot][col])) pivot = r;
    }
    if (std::fabs(a[pivot][col]) < 1e-300) return;  // keep the previous fit
    std::swap(a[col], a[pivot]);
    for (int r = 0; r < kFeatures; ++r) {
      if (r == col) continue;
      const double f = a[r][col] / a[col][col];
      for (int c = col; c <= kFeatures; ++c) a[r][c] -= f * a[col][c];
    }
  }
  for (int i = 0; i < kFeatures; ++i) coef_[i] = a[i][kFeatures] / a[i][i];
}

absl::Duration StepCostModel::Predict(const StepShape& shape) const {
  const auto x = Features(shape);
  double t = 0;
  for (int i = 0; i < kFeatures; ++i) t += coef_[i] * x[i];
  return absl::Seconds(std::max(t, 0.0));
}

double StepCostModel::PrefillTokenSeconds(int64_t pos) const {
  const double per = coef_[3] + coef_[4] * static_cast<double>(pos) * kAttentionScale;
  return std::max(per, kMinTokenSeconds);
}

}  // namespace kvcache::sched
