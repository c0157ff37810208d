#include "worker/model/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "absl/strings/str_cat.h"

namespace kvcache::model {

absl::Status ValidateSamplingConfig(const SamplingConfig& c, int vocab_size) {
  if (!(c.temperature >= 0.0f && c.temperature <= 2.0f)) {
    return absl::InvalidArgumentError(absl::StrCat("temperature ", c.temperature, " outside [0, 2]"));
  }
  if (c.top_k < 0 || c.top_k > vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat("top_k ", c.top_k, " outside [0, ", vocab_size, "]"));
  }
  if (!(c.top_p >= 0.0f && c.top_p <= 1.0f)) {
    return absl::InvalidArgumentError(absl::StrCat("top_p ", c.top_p, " outside [0, 1]"));
  }
  return absl::OkStatus();
}

int32_t Argmax(absl::Span<const float> v) {
  // Two passes: the largest value that is not NaN, then the first index holding it.
  // A greedy step of 16 sessions runs this over 16 vocabularies on the engine's
  // thread while the kernel threads wait, so both passes go 16 floats at a time.
  const float* x = v.data();
  const size_t n = v.size();
  float best = -std::numeric_limits<float>::infinity();
  size_t i = 0;
#if defined(__SSE2__)
  __m128 m[4];
  for (__m128& mj : m) mj = _mm_set1_ps(best);
  for (; i + 16 <= n; i += 16) {
    // maxps returns its second operand when the first is NaN: NaN never enters m.
    for (int j = 0; j < 4; ++j) m[j] = _mm_max_ps(_mm_loadu_ps(x + i + 4 * j), m[j]);
  }
  alignas(16) float lanes[4];
  _mm_store_ps(lanes, _mm_max_ps(_mm_max_ps(m[0], m[1]), _mm_max_ps(m[2], m[3])));
  for (float f : lanes) best = std::max(best, f);
#endif
  for (; i < n; ++i) {
    if (x[i] > best) best = x[i];
  }
  i = 0;
#if defined(__SSE2__)
  const __m128 b4 = _mm_set1_ps(best);
  for (; i + 16 <= n; i += 16) {
    int mask = 0;
    for (int j = 0; j < 4; ++j)
      mask |= _mm_movemask_ps(_mm_cmpeq_ps(_mm_loadu_ps(x + i + 4 * j), b4)) << 4 * j;
    if (mask != 0) return static_cast<int32_t>(i + __builtin_ctz(static_cast<unsigned>(mask)));
  }
#endif
  for (; i < n; ++i) {
    if (x[i] == best) return static_cast<int32_t>(i);
  }
  return 0;  // every value NaN
}

Sampler::Sampler(const SamplingConfig& config) : config_(config), rng_(config.seed) {}

double Sampler::Uniform() { return static_cast<double>(rng_() >> 11) * 0x1.0p-53; }

int32_t Sampler::Sample(absl::Span<const float> logits) {
  if (config_.temperature == 0.0f || config_.top_k == 1) return Argmax(logits);

  // Candidates sorted by logit (descending, ties by id), cut to top_k.
  candidates_.clear();
  candidates_.reserve(logits.size());
  for (size_t i = 0; i < logits.size(); ++i) {
    candidates_.emplace_back(logits[i], static_cast<int32_t>(i));
  }
  auto better = [](const auto& a, const auto& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  size_t keep = candidates_.size();
  if (config_.top_k > 0 && static_cast<size_t>(config_.top_k) < keep) {
    keep = static_cast<size_t>(config_.top_k);
    std::partial_sort(candidates_.begin(), candidates_.begin() + keep, candidates_.end(), better);
    candidates_.resize(keep);
  } else {
    std::sort(candidates_.begin(), candidates_.end(), better);
  }

  // Softmax at temperature, in double for stable sums.
  const double inv_t = 1.0 / config_.temperature;
  const double max_logit = candidates_.front().first;
  std::vector<double> probs(candidates_.size());
  double total = 0;
  for (size_t i = 0; i < candidates_.size(); ++i) {
    probs[i] = std::exp((candidates_[i].first - max_logit) * inv_t);
    total += probs[i];
  }
  // Nucleus: the smallest prefix whose mass reaches top_p.
  if (config_.top_p > 0.0f && config_.top_p < 1.0f) {
    double mass = 0;
    size_t cut = probs.size();
    for (size_t i = 0; i < probs.size(); ++i) {
      mass += probs[i] / total;
      if (mass >= config_.top_p) {
        cut = i + 1;
        break;
      }
    }
    probs.resize(cut);
    total = 0;
    for (double p : probs) total += p;
  }
  double r = Uniform() * total;
  for (size_t i = 0; i < probs.size(); ++i) {
    r -= probs[i];
    if (r < 0) return candidates_[i].second;
  }
  return candidates_[probs.size() - 1].second;  // rounding left r >= 0
}

StopCriteria::StopCriteria(std::vector<int32_t> eos_ids, std::vector<int32_t> stop_token_ids,
                           std::vector<std::string> stop_strings, int max_tokens, bool ignore_eos)
    : eos_ids_(std::move(eos_ids)),
      stop_token_ids_(std::move(stop_token_ids)),
      stop_strings_(std::move(stop_strings)),
      max_tokens_(max_tokens),
      ignore_eos_(ignore_eos) {
  for (const auto& s : stop_strings_) longest_stop_ = std::max(longest_stop_, s.size());
}

StopCriteria::Reason StopCriteria::Add(int32_t token, const std::string& text_delta) {
  ++generated_;
  auto contains = [token](const std::vector<int32_t>& ids) {
    return std::find(ids.begin(), ids.end(), token) != ids.end();
  };
  if (!ignore_eos_ && contains(eos_ids_)) return Reason::kEos;
  if (contains(stop_token_ids_)) return Reason::kStopToken;
  if (longest_stop_ > 0 && !text_delta.empty()) {
    // A stop string may straddle tokens: search the kept tail plus the new text,
    // only where a match would end inside the new text.
    const size_t old_len = tail_.size();
    tail_ += text_delta;
    for (const auto& s : stop_strings_) {
      if (s.empty() || s.size() > tail_.size()) continue;
      const size_t from = old_len >= s.size() - 1 ? old_len - (s.size() - 1) : 0;
      if (tail_.find(s, from) != std::string::npos) return Reason::kStopString;
    }
    if (tail_.size() >= longest_stop_) tail_.erase(0, tail_.size() - (longest_stop_ - 1));
  }
  if (generated_ >= max_tokens_) return Reason::kLength;
  return Reason::kNone;
}

}  // namespace kvcache::model
