#include "worker/model/sampler.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "absl/strings/str_cat.h"
#include "xxhash.h"

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

Sampler::Sampler(const SamplingConfig& config) : config_(config) {}

double Sampler::Uniform() const {
  unsigned char bytes[8];  // the index, little-endian on every host
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<unsigned char>(index_ >> (8 * i));
  return static_cast<double>(XXH64(bytes, sizeof(bytes), config_.seed) >> 11) * 0x1.0p-53;
}

namespace {

// exp(x) for x <= 0 in IEEE single operations only (no library call, no fused
// multiply-add: this file builds with -ffp-contract=off), so that a seed gives the
// same tokens on every machine and build. 0 below -87 and for NaN. exp(x) =
// 2^k * e^r with k = round(x / ln 2), |r| <= ln 2 / 2, e^r by its Taylor series to
// r^7: relative error 1.0e-7 at most over every 13th float in [-87, 0] (against
// exp in double), plenty for sampling weights.
constexpr float kLog2e = 1.44269504f;
constexpr float kRoundMagic = 12582912.0f;  // 1.5 * 2^23: (y + it) - it rounds y to an integer
constexpr float kLn2Hi = 0.693359375f;      // ln 2 = kLn2Hi + kLn2Lo; k * kLn2Hi is exact
constexpr float kLn2Lo = -2.12194440e-4f;
constexpr float kExpMin = -87.0f;  // 2^k stays a normal float
constexpr float kTaylor[] = {1.0f / 5040, 1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};

float ExpNonPositive(float x) {
  if (!(x >= kExpMin)) return 0.0f;
  const float k = (x * kLog2e + kRoundMagic) - kRoundMagic;
  const float r = (x - k * kLn2Hi) - k * kLn2Lo;
  float p = kTaylor[0];
  for (int i = 1; i < 8; ++i) p = p * r + kTaylor[i];
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

#if defined(__SSE2__)
// ExpNonPositive of four lanes, bit for bit.
__m128 ExpNonPositive4(__m128 x) {
  const __m128 valid = _mm_cmpge_ps(x, _mm_set1_ps(kExpMin));  // false for NaN
  x = _mm_max_ps(x, _mm_set1_ps(kExpMin));                     // NaN -> kExpMin (masked out below)
  const __m128 magic = _mm_set1_ps(kRoundMagic);
  const __m128 k = _mm_sub_ps(_mm_add_ps(_mm_mul_ps(x, _mm_set1_ps(kLog2e)), magic), magic);
  const __m128 r =
      _mm_sub_ps(_mm_sub_ps(x, _mm_mul_ps(k, _mm_set1_ps(kLn2Hi))), _mm_mul_ps(k, _mm_set1_ps(kLn2Lo)));
  __m128 p = _mm_set1_ps(kTaylor[0]);
  for (int i = 1; i < 8; ++i) p = _mm_add_ps(_mm_mul_ps(p, r), _mm_set1_ps(kTaylor[i]));
  const __m128i bits = _mm_slli_epi32(_mm_add_epi32(_mm_cvttps_epi32(k), _mm_set1_epi32(127)), 23);
  return _mm_and_ps(_mm_mul_ps(p, _mm_castsi128_ps(bits)), valid);
}
#endif

}  // namespace

double SoftmaxWeights(absl::Span<const float> logits, float max, float inv_t, float* w) {
  const size_t n = logits.size();
  double sum[4] = {0, 0, 0, 0};
  size_t i = 0;
#if defined(__SSE2__)
  __m128d s01 = _mm_setzero_pd(), s23 = _mm_setzero_pd();
  const __m128 m = _mm_set1_ps(max), t = _mm_set1_ps(inv_t);
  for (; i + 4 <= n; i += 4) {
    const __m128 e = ExpNonPositive4(_mm_mul_ps(_mm_sub_ps(_mm_loadu_ps(logits.data() + i), m), t));
    _mm_storeu_ps(w + i, e);
    s01 = _mm_add_pd(s01, _mm_cvtps_pd(e));
    s23 = _mm_add_pd(s23, _mm_cvtps_pd(_mm_movehl_ps(e, e)));
  }
  _mm_storeu_pd(sum, s01);
  _mm_storeu_pd(sum + 2, s23);
#endif
  for (; i < n; ++i) {
    w[i] = ExpNonPositive((logits[i] - max) * inv_t);
    sum[i % 4] += w[i];
  }
  return (sum[0] + sum[1]) + (sum[2] + sum[3]);
}

int32_t Sampler::Sample(absl::Span<const float> logits) {
  const int32_t token = Pick(logits);
  ++index_;  // every token has its place, drawn or not
  return token;
}

int32_t Sampler::Pick(absl::Span<const float> logits) {
  if (config_.temperature == 0.0f || config_.top_k == 1) return Argmax(logits);
  const int32_t top = Argmax(logits);
  const float max_logit = logits[top];
  // Every logit NaN or -inf, or one +inf: the largest is the only choice.
  if (!std::isfinite(max_logit)) return top;
  const float inv_t = 1.0f / config_.temperature;
  const size_t n = logits.size();
  const bool top_k = config_.top_k > 0 && static_cast<size_t>(config_.top_k) < n;
  const bool nucleus = config_.top_p > 0.0f && config_.top_p < 1.0f;
  auto better = [logits](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };
  // One uniform draw over the weights w(0..count) of tokens id(0..count) that
  // add up to `sum`; those weighing 0 are never chosen.
  auto draw = [this, top](size_t count, double sum, auto w, auto id) {
    double r = Uniform() * sum;
    int32_t last = top;  // the first candidate, weighing 1
    for (size_t j = 0; j < count; ++j) {
      if (w(j) == 0) continue;
      last = id(j);
      r -= w(j);
      if (r < 0) break;
    }
    return last;  // also when rounding left r >= 0
  };

  // Kept candidates by logit (descending, ties by id) and their weights: ids_,
  // kept_. Only as many are sorted as the cut needs.
  ids_.clear();
  kept_.clear();
  double total = 0;  // of the candidates top_k keeps (all of them without it)
  size_t sorted = 0;
  if (top_k) {
    for (size_t i = 0; i < n; ++i) {
      if (!std::isnan(logits[i])) ids_.push_back(static_cast<int32_t>(i));
    }
    const size_t keep = std::min(ids_.size(), static_cast<size_t>(config_.top_k));
    std::nth_element(ids_.begin(), ids_.begin() + keep - 1, ids_.end(), better);
    std::sort(ids_.begin(), ids_.begin() + keep, better);
    ids_.resize(keep);
    for (int32_t id : ids_) {
      kept_.push_back(ExpNonPositive((logits[id] - max_logit) * inv_t));
      total += kept_.back();
    }
    sorted = keep;
  } else {
    weights_.resize(n);
    total = SoftmaxWeights(logits, max_logit, inv_t, weights_.data());
    if (!nucleus) {
      // No cut: the whole vocabulary in id order, nothing to sort (a full sort of
      // a 49k vocabulary took longer than a decode step of the 135M model).
      return draw(
          n, total, [this](size_t i) { return static_cast<double>(weights_[i]); },
          [](size_t i) { return static_cast<int32_t>(i); });
    }
    // A token weighing less than (1 - top_p) * total / n cannot be in the nucleus:
    // it and every token after it weigh less than 1 - top_p of the mass together,
    // so the tokens before it reach top_p. Half that, for rounding.
    const double least = (1.0 - config_.top_p) * total / (2.0 * static_cast<double>(n));
    for (size_t i = 0; i < n; ++i) {
      if (weights_[i] >= least) ids_.push_back(static_cast<int32_t>(i));
    }
  }

  size_t cut = ids_.size();  // rounding may leave the mass short of top_p: then all of them
  if (nucleus) {             // the smallest prefix whose mass reaches top_p
    double mass = 0;
    bool reached = false;
    for (size_t j = 0, want = 64; !reached && j < ids_.size(); want *= 4) {
      if (want > sorted) {  // sort the next candidates (top_k sorted them all)
        want = std::min(want, ids_.size());
        if (want < ids_.size())
          std::nth_element(ids_.begin() + sorted, ids_.begin() + want, ids_.end(), better);
        std::sort(ids_.begin() + sorted, ids_.begin() + want, better);
        for (size_t i = sorted; i < want; ++i) kept_.push_back(weights_[ids_[i]]);
        sorted = want;
      }
      for (; j < sorted; ++j) {
        mass += kept_[j] / total;
        if (mass >= config_.top_p) {
          cut = j + 1;
          reached = true;
          break;
        }
      }
    }
  }
  double sum = 0;
  for (size_t j = 0; j < cut; ++j) sum += kept_[j];
  return draw(
      cut, sum, [this](size_t j) { return kept_[j]; }, [this](size_t j) { return ids_[j]; });
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
