// Token sampling: greedy, temperature, top-k, top-p, with a seeded generator so
// that the same seed, input and cache give the same tokens on any machine.
//
// Thread-safety: a Sampler is owned by one request; not thread-safe.
#ifndef KVCACHE_WORKER_MODEL_SAMPLER_H_
#define KVCACHE_WORKER_MODEL_SAMPLER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"

namespace kvcache::model {

struct SamplingConfig {
  float temperature = 0.0f;  // 0 = greedy; (0, 2]
  int top_k = 0;             // 0 = off; otherwise keep the k most likely tokens
  float top_p = 1.0f;        // 0 or 1 = off; otherwise keep the smallest set with mass >= top_p
  uint64_t seed = 0;
};

// INVALID_ARGUMENT naming the field when a value is out of range.
absl::Status ValidateSamplingConfig(const SamplingConfig& config, int vocab_size);

class Sampler {
 public:
  // REQUIRES: ValidateSamplingConfig(config, ...) is OK.
  explicit Sampler(const SamplingConfig& config);

  // Picks the next token from `logits` [vocab]. Greedy picks the largest logit
  // (lowest id on ties) and never touches the generator. Otherwise one uniform
  // draw walks the candidates' softmax weights at the temperature: the whole
  // vocabulary in id order when neither top_k nor top_p cuts it, else the kept
  // candidates by logit (descending, lowest id on ties). NaN logits are never
  // chosen.
  int32_t Sample(absl::Span<const float> logits);
  // Passes over the next `n` tokens without sampling them: tokens generated
  // before (a stream continued on another worker). Sampling then goes on as if
  // they had been sampled here.
  void Skip(int64_t n) { index_ += static_cast<uint64_t>(n); }

 private:
  // Sample without moving to the next token.
  int32_t Pick(absl::Span<const float> logits);
  // The draw of the current token: uniform in [0, 1) from 53 bits of xxHash64
  // of (seed, token index), identical on every platform. A token's draw depends
  // on the seed and its place in the output alone (not on the draws before it),
  // which Skip needs.
  double Uniform() const;

  SamplingConfig config_;
  uint64_t index_ = 0;  // of the token being sampled, in the request's output
  // Scratch, reused: candidate token ids, their unnormalised probabilities in
  // that order, and every token's by id.
  std::vector<int32_t> ids_;
  std::vector<double> kept_;
  std::vector<float> weights_;
};

// w[i] = exp((logits[i] - max) * inv_t), the softmax weights at temperature
// 1 / inv_t, for logits[i] <= max; 0 below exp(-87) and for NaN. Returns their
// sum, added in double as four running sums (of i % 4 == 0, 1, 2, 3), then
// (s0 + s1) + (s2 + s3). IEEE single operations only (relative error about 1e-7):
// the same bits on every machine and build, whichever of its routes an element
// takes. REQUIRES: w holds logits.size() floats.
double SoftmaxWeights(absl::Span<const float> logits, float max, float inv_t, float* w);

// The index of the largest value (lowest index on ties). NaN is never chosen
// unless every value is NaN (then 0). REQUIRES: !v.empty().
int32_t Argmax(absl::Span<const float> v);

// Decides when generation ends. Text is fed as the streaming detokenizer emits it.
class StopCriteria {
 public:
  enum class Reason { kNone, kEos, kStopToken, kStopString, kLength, kContextFull };

  StopCriteria(std::vector<int32_t> eos_ids, std::vector<int32_t> stop_token_ids,
               std::vector<std::string> stop_strings, int max_tokens, bool ignore_eos);

  // Records one generated token and the text it completed; returns why generation
  // must stop after it, or kNone.
  Reason Add(int32_t token, const std::string& text_delta);
  int generated() const { return generated_; }

 private:
  std::vector<int32_t> eos_ids_;
  std::vector<int32_t> stop_token_ids_;
  std::vector<std::string> stop_strings_;
  int max_tokens_;
  bool ignore_eos_;
  int generated_ = 0;
  std::string tail_;  // the last (longest stop string - 1 + delta) bytes of output
  size_t longest_stop_ = 0;
};

}  // namespace kvcache::model

#endif  // KVCACHE_WORKER_MODEL_SAMPLER_H_
