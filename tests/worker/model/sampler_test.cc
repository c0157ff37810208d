#include "worker/model/sampler.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <random>

#include "gtest/gtest.h"

namespace kvcache::model {
namespace {

std::vector<float> Logits(std::initializer_list<float> v) { return std::vector<float>(v); }

TEST(SamplerTest, GreedyPicksLargestAndLowestIdOnTies) {
  Sampler s(SamplingConfig{});
  EXPECT_EQ(s.Sample(Logits({0.1f, 3.0f, -1.0f, 2.9f})), 1);
  EXPECT_EQ(s.Sample(Logits({5.0f, 5.0f, 1.0f})), 0);
  EXPECT_EQ(Argmax(Logits({-3.0f, -2.0f, -2.0f})), 1);
}

TEST(SamplerTest, ArgmaxIsTheFirstLargestAndSkipsNan) {
  EXPECT_EQ(Argmax(Logits({-7.0f})), 0);
  EXPECT_EQ(Argmax(Logits({1.0f, 5.0f, NAN, 5.0f, -2.0f})), 1);
  EXPECT_EQ(Argmax(Logits({NAN, -1.0f, -3.0f})), 1);
  EXPECT_EQ(Argmax(Logits({NAN, NAN})), 0);
  EXPECT_EQ(Argmax(Logits({-INFINITY, -INFINITY})), 0);
  EXPECT_EQ(Argmax(Logits({0.0f, -0.0f, 0.0f})), 0);
  // Against the plain loop on random vectors of every length around the vector
  // widths, with ties and NaNs planted anywhere (the tails included).
  std::mt19937 rng(5);
  for (int n = 1; n <= 70; ++n) {
    for (int trial = 0; trial < 20; ++trial) {
      std::vector<float> v(static_cast<size_t>(n));
      for (float& f : v) f = static_cast<float>(rng() % 9) - 4.0f;  // many ties
      if (trial % 3 == 0) v[rng() % n] = NAN;
      if (trial % 5 == 0) v[rng() % n] = 1e30f;
      int32_t want = -1;
      for (int i = 0; i < n; ++i) {
        if (!std::isnan(v[i]) && (want < 0 || v[i] > v[want])) want = i;
      }
      ASSERT_EQ(Argmax(v), std::max(want, 0)) << "n=" << n << " trial=" << trial;
    }
  }
}

// The weights are exp to within 2e-7, 0 for NaN and far below the maximum, and
// an element's bits do not depend on its route (four lanes at a time, or the
// scalar tail): each one alone equals it within a longer span at any offset.
TEST(SamplerTest, SoftmaxWeightsAreExpAndTheSameOnEveryRoute) {
  std::mt19937 rng(9);
  std::uniform_real_distribution<float> u(-30.0f, 0.0f);
  for (int n = 1; n <= 37; ++n) {
    std::vector<float> logits(static_cast<size_t>(n));
    for (float& l : logits) l = u(rng);
    logits[rng() % n] = 0.0f;
    if (n > 3) logits[rng() % n] = NAN;
    if (n > 5) logits[rng() % n] = -INFINITY;
    if (n > 7) logits[rng() % n] = -200.0f;
    for (float inv_t : {0.5f, 1.0f, 1.7f}) {
      std::vector<float> w(logits.size());
      const double total = SoftmaxWeights(logits, 0.0f, inv_t, w.data());
      double lanes[4] = {0, 0, 0, 0};
      for (int i = 0; i < n; ++i) {
        const double x = static_cast<double>(logits[i] * inv_t);
        if (std::isnan(logits[i]) || x < -87) {
          EXPECT_EQ(w[i], 0.0f) << i;
        } else {
          EXPECT_NEAR(w[i] / std::exp(x), 1.0, 2e-7) << "x=" << x;
        }
        float alone;
        SoftmaxWeights(absl::MakeConstSpan(&logits[i], 1), 0.0f, inv_t, &alone);
        EXPECT_EQ(alone, w[i]) << "n=" << n << " i=" << i;
        lanes[i % 4] += w[i];
      }
      EXPECT_EQ(total, (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]));
    }
  }
}

TEST(SamplerTest, SameSeedSameTokensDifferentSeedDiffers) {
  std::vector<float> logits(100);
  for (int i = 0; i < 100; ++i) logits[i] = std::sin(i * 0.7f);
  auto run = [&](uint64_t seed) {
    Sampler s(SamplingConfig{1.0f, 0, 1.0f, seed});
    std::vector<int32_t> out;
    for (int i = 0; i < 50; ++i) out.push_back(s.Sample(logits));
    return out;
  };
  EXPECT_EQ(run(42), run(42));
  EXPECT_NE(run(42), run(43));
}

TEST(SamplerTest, TopKOneAndTinyTopPAreGreedy) {
  std::vector<float> logits = Logits({0.5f, 2.0f, 1.9f, -4.0f});
  Sampler k1(SamplingConfig{1.5f, 1, 1.0f, 7});
  Sampler p(SamplingConfig{1.5f, 0, 0.01f, 7});
  for (int i = 0; i < 20; ++i) {
    EXPECT_EQ(k1.Sample(logits), 1);
    EXPECT_EQ(p.Sample(logits), 1);
  }
}

TEST(SamplerTest, TopKNeverPicksOutsideTheTopK) {
  std::vector<float> logits = Logits({1.0f, 0.9f, 0.8f, 0.7f, 0.6f});
  Sampler s(SamplingConfig{2.0f, 2, 1.0f, 3});
  for (int i = 0; i < 500; ++i) EXPECT_LT(s.Sample(logits), 2);
}

TEST(SamplerTest, FrequenciesFollowSoftmax) {
  // p = softmax([0, ln 2, ln 3]) = [1/6, 2/6, 3/6]
  std::vector<float> logits = {0.0f, std::log(2.0f), std::log(3.0f)};
  Sampler s(SamplingConfig{1.0f, 0, 1.0f, 11});
  std::map<int, int> counts;
  const int n = 60000;
  for (int i = 0; i < n; ++i) ++counts[s.Sample(logits)];
  EXPECT_NEAR(counts[0] / double(n), 1.0 / 6, 0.01);
  EXPECT_NEAR(counts[1] / double(n), 2.0 / 6, 0.01);
  EXPECT_NEAR(counts[2] / double(n), 3.0 / 6, 0.01);
}

TEST(SamplerTest, TopPDropsTheTail) {
  // p = [0.5, 0.3, 0.2]: top_p 0.7 keeps the first two.
  std::vector<float> logits = {std::log(0.5f), std::log(0.3f), std::log(0.2f)};
  Sampler s(SamplingConfig{1.0f, 0, 0.7f, 5});
  std::map<int, int> counts;
  for (int i = 0; i < 20000; ++i) ++counts[s.Sample(logits)];
  EXPECT_EQ(counts[2], 0);
  EXPECT_NEAR(counts[0] / 20000.0, 0.5 / 0.8, 0.015);
}

// A large vocabulary whose nucleus spans hundreds of tokens (past the first
// candidates sorted): 300 equal top logits at scattered ids, the rest far below. top_p 0.5 keeps the 150 of
// them with the lowest ids, each equally likely; no cut draws from all 300; top_k 200 keeps the 200 lowest
// ids of them.
TEST(SamplerTest, CutsOnALargeVocabularyKeepTheRightCandidates) {
  constexpr int kVocab = 8192, kTop = 300;
  std::vector<float> logits(kVocab, -40.0f);
  std::vector<int32_t> top_ids;
  for (int j = 0; j < kTop; ++j) top_ids.push_back((j * 7919 + 11) % kVocab);
  for (int32_t id : top_ids) logits[id] = 0.0f;
  std::sort(top_ids.begin(), top_ids.end());
  logits[5] = NAN;  // never chosen
  auto draw = [&](SamplingConfig config, int n) {
    Sampler s(config);
    std::map<int32_t, int> counts;
    for (int i = 0; i < n; ++i) ++counts[s.Sample(logits)];
    return counts;
  };
  auto only = [](const std::map<int32_t, int>& counts, const std::vector<int32_t>& allowed) {
    for (const auto& [id, count] : counts) {
      if (std::find(allowed.begin(), allowed.end(), id) == allowed.end()) return false;
    }
    return true;
  };
  const int n = 6000;
  const std::vector<int32_t> half(top_ids.begin(), top_ids.begin() + kTop / 2);
  auto nucleus = draw(SamplingConfig{1.0f, 0, 0.5f, 3}, n);
  EXPECT_TRUE(only(nucleus, half));
  EXPECT_EQ(nucleus.size(), half.size());
  for (const auto& [id, count] : nucleus) EXPECT_NEAR(count, n / (kTop / 2.0), 30) << id;
  auto all = draw(SamplingConfig{1.0f, 0, 1.0f, 4}, n);
  EXPECT_TRUE(only(all, top_ids));  // the rest together: about 1e-15 of the mass
  EXPECT_EQ(all.size(), top_ids.size());
  auto top_k = draw(SamplingConfig{1.0f, 200, 1.0f, 5}, 4000);
  EXPECT_TRUE(only(top_k, std::vector<int32_t>(top_ids.begin(), top_ids.begin() + 200)));
  EXPECT_EQ(top_k.size(), 200u);
}

TEST(SamplerTest, NanLogitsAreNeverChosen) {
  std::vector<float> logits = {NAN, 0.0f, NAN, 0.1f, NAN};
  for (SamplingConfig config : {SamplingConfig{2.0f, 0, 1.0f, 1}, SamplingConfig{2.0f, 0, 0.99f, 2},
                                SamplingConfig{2.0f, 4, 1.0f, 3}}) {
    Sampler s(config);
    std::map<int32_t, int> counts;
    for (int i = 0; i < 2000; ++i) ++counts[s.Sample(logits)];
    EXPECT_EQ(counts.size(), 2u);
    EXPECT_GT(counts[1], 0);
    EXPECT_GT(counts[3], 0);
  }
  // Nothing finite: the largest (an infinity) or the first.
  Sampler s(SamplingConfig{1.0f, 0, 1.0f, 1});
  EXPECT_EQ(s.Sample(std::vector<float>{NAN, -INFINITY, INFINITY}), 2);
  EXPECT_EQ(s.Sample(std::vector<float>{NAN, NAN}), 0);
}

TEST(SamplerTest, ValidationNamesTheField) {
  EXPECT_TRUE(ValidateSamplingConfig({}, 10).ok());
  EXPECT_EQ(ValidateSamplingConfig({-0.1f, 0, 1, 0}, 10).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateSamplingConfig({2.5f, 0, 1, 0}, 10).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateSamplingConfig({NAN, 0, 1, 0}, 10).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateSamplingConfig({1, -1, 1, 0}, 10).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateSamplingConfig({1, 11, 1, 0}, 10).code(), absl::StatusCode::kInvalidArgument);
  auto s = ValidateSamplingConfig({1, 0, 1.5f, 0}, 10);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("top_p"), absl::string_view::npos);
}

TEST(StopCriteriaTest, EosStopTokenAndLength) {
  StopCriteria c({2}, {7}, {}, 3, false);
  EXPECT_EQ(c.Add(5, "a"), StopCriteria::Reason::kNone);
  EXPECT_EQ(c.Add(2, ""), StopCriteria::Reason::kEos);
  StopCriteria t({2}, {7}, {}, 10, false);
  EXPECT_EQ(t.Add(7, ""), StopCriteria::Reason::kStopToken);
  StopCriteria l({2}, {}, {}, 2, true);
  EXPECT_EQ(l.Add(2, ""), StopCriteria::Reason::kNone);  // ignore_eos
  EXPECT_EQ(l.Add(2, ""), StopCriteria::Reason::kLength);
}

TEST(StopCriteriaTest, StopStringAcrossTokens) {
  StopCriteria c({}, {}, {"END", "x"}, 100, false);
  EXPECT_EQ(c.Add(1, "the E"), StopCriteria::Reason::kNone);
  EXPECT_EQ(c.Add(1, "N"), StopCriteria::Reason::kNone);
  EXPECT_EQ(c.Add(1, "D!"), StopCriteria::Reason::kStopString);
  StopCriteria one({}, {}, {"x"}, 100, false);
  EXPECT_EQ(one.Add(1, "ab"), StopCriteria::Reason::kNone);
  EXPECT_EQ(one.Add(1, "cx"), StopCriteria::Reason::kStopString);
  StopCriteria none({}, {}, {"ENDING"}, 100, false);
  for (const char* d : {"EN", "DIN", "X", "ENDIN"}) EXPECT_EQ(none.Add(1, d), StopCriteria::Reason::kNone);
  EXPECT_EQ(none.Add(1, "G"), StopCriteria::Reason::kStopString);
}

}  // namespace
}  // namespace kvcache::model
