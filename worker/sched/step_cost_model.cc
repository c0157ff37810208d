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
  if (shape.prefill_tokens > 0) ++prefill_steps_;
  if (shape.decode_tokens > 0) ++decode_steps_;
  Solve();
}

void StepCostModel::Solve() {
  // Non-negative least squares by active sets: every cost is at least zero (a
  // decode never makes a step faster), and features that move together (decode
  // tokens and their context, prefill tokens and their attention) cannot trade
  // a large positive coefficient for a large negative one. Solve the ridge-
  // regularised normal equations over the free features; drop the most negative
  // one and solve again. The small ridge keeps features the recent steps never
  // varied at zero instead of making the system singular.
  double trace = 0;
  for (int i = 0; i < kFeatures; ++i) trace += xtx_[i][i];
  const double ridge = 1e-9 * std::max(trace, 1.0);
  std::array<bool, kFeatures> free;
  free.fill(true);
  std::array<double, kFeatures> coef{};
  for (int round = 0; round < kFeatures; ++round) {
    std::array<std::array<double, kFeatures + 1>, kFeatures> a{};
    for (int i = 0; i < kFeatures; ++i) {
      for (int j = 0; j < kFeatures; ++j) a[i][j] = free[i] && free[j] ? xtx_[i][j] : 0.0;
      a[i][i] += free[i] ? ridge : 1.0;
      a[i][kFeatures] = free[i] ? xty_[i] : 0.0;
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
    for (int i = 0; i < kFeatures; ++i) coef[i] = free[i] ? a[i][kFeatures] / a[i][i] : 0.0;
    int worst = -1;
    for (int i = 1; i < kFeatures; ++i) {  // the fixed cost may be anything
      if (free[i] && coef[i] < 0 && (worst < 0 || coef[i] < coef[worst])) worst = i;
    }
    if (worst < 0) break;
    free[worst] = false;
  }
  for (int i = 1; i < kFeatures; ++i) coef[i] = std::max(coef[i], 0.0);
  coef_ = coef;
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
