// Every CPU kernel against a plain scalar reference (double accumulation), at
// every kernel level this machine supports (scalar, avx2, avx512).
#include <algorithm>
#include <array>
#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/casts.h"
#include "absl/status/status.h"
#include "common/gguf/fp16.h"
#include "common/gguf/ggml_types.h"
#include "gtest/gtest.h"
#include "worker/backend/cpu/attention.h"
#include "worker/backend/cpu/cpu_features.h"
#include "worker/backend/cpu/matmul.h"
#include "worker/backend/cpu/ops.h"
#include "worker/kv/page_layout.h"

namespace kvcache::cpu {
namespace {

using gguf::GgmlType;

std::vector<float> RandomVec(std::mt19937& rng, int64_t n, float lo = -1.0f, float hi = 1.0f) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = dist(rng);
  return v;
}

// A weight matrix quantised with the reference quantiser, plus its f32 decoding.
struct TestWeights {
  std::vector<uint8_t> bytes;
  std::vector<float> deq;  // [rows][cols]
  WeightView view;
};

TestWeights MakeWeights(std::mt19937& rng, GgmlType type, int64_t rows, int64_t cols) {
  TestWeights w;
  const int64_t row_bytes = *gguf::RowBytes(type, cols);
  w.bytes.resize(static_cast<size_t>(rows * row_bytes));
  w.deq.resize(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    // Rows of different magnitude and a positive offset so Q4_1's m term matters.
    std::vector<float> src = RandomVec(rng, cols, -0.5f, 1.0f + static_cast<float>(r % 5));
    EXPECT_TRUE(gguf::QuantizeRow(type, src.data(), w.bytes.data() + r * row_bytes, cols).ok());
    EXPECT_TRUE(
        gguf::DequantizeRow(type, w.bytes.data() + r * row_bytes, w.deq.data() + r * cols, cols).ok());
  }
  w.view = {type, w.bytes.data(), rows, cols};
  return w;
}

// Random but valid blocks: every quant byte random (all codes, every scale and min
// of the k-quants, negative Q6_K scales), f16 scales of sane magnitude. Reaches
// corners the reference quantiser does not produce.
TestWeights MakeRandomBlockWeights(std::mt19937& rng, GgmlType type, int64_t rows, int64_t cols) {
  TestWeights w;
  const int64_t row_bytes = *gguf::RowBytes(type, cols);
  const int64_t block_bytes = gguf::TypeTraits(type).type_size;
  w.bytes.resize(static_cast<size_t>(rows * row_bytes));
  for (uint8_t& b : w.bytes) b = static_cast<uint8_t>(rng());
  std::uniform_real_distribution<float> scale(0.001f, 0.05f);
  for (int64_t off = 0; off < static_cast<int64_t>(w.bytes.size()); off += block_bytes) {
    const uint16_t d = gguf::Fp32ToFp16(scale(rng) * (rng() % 2 ? 1.0f : -1.0f));
    const uint16_t dmin = gguf::Fp32ToFp16(scale(rng));
    uint8_t* blk = w.bytes.data() + off;
    if (type == GgmlType::kQ6_K) {
      std::memcpy(blk + offsetof(gguf::BlockQ6_K, d), &d, 2);
    } else {
      std::memcpy(blk, &d, 2);  // d is the first field of every other block
      if (type == GgmlType::kQ4_K || type == GgmlType::kQ5_K || type == GgmlType::kQ4_1) {
        std::memcpy(blk + 2, &dmin, 2);  // dmin / m second
      }
    }
  }
  w.deq.resize(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    EXPECT_TRUE(
        gguf::DequantizeRow(type, w.bytes.data() + r * row_bytes, w.deq.data() + r * cols, cols).ok());
  }
  w.view = {type, w.bytes.data(), rows, cols};
  return w;
}

class CpuKernelsTest : public ::testing::TestWithParam<CpuKernelLevel> {
 protected:
  void SetUp() override { ASSERT_TRUE(SetCpuKernelLevel(GetParam()).ok()); }
  void TearDown() override {
    ASSERT_TRUE(SetCpuKernelLevel(MaxSupportedCpuKernelLevel()).ok());
    SetNumThreads(2);
  }
};

// ---------------------------------------------------------------- MatMul

struct MatMulCase {
  GgmlType type;
  int64_t rows, cols;
};

// Checks y against (a) the exact product of the decoded weights with x and, for
// the Q8 integer path, (b) the product with the quantised activations it used.
void CheckMatMul(const TestWeights& w, const std::vector<float>& x, int n_tokens, const std::vector<float>& y,
                 int64_t y_stride, bool q8_path) {
  const int64_t rows = w.view.rows, cols = w.view.cols;
  std::vector<int8_t> aq;
  std::vector<float> ad, as;
  if (q8_path) {
    aq.resize(static_cast<size_t>(n_tokens * cols));
    ad.resize(static_cast<size_t>(n_tokens * cols / 32));
    as.resize(ad.size());
    QuantizeActivationsQ8(x.data(), cols, n_tokens, cols, aq.data(), ad.data(), as.data());
  }
  for (int t = 0; t < n_tokens; ++t) {
    for (int64_t r = 0; r < rows; ++r) {
      const float* wr = w.deq.data() + r * cols;
      const float* xt = x.data() + t * cols;
      double exact = 0, abs_sum = 0, q8_bound = 0, exact_q = 0, abs_sum_q = 0;
      for (int64_t c = 0; c < cols; ++c) {
        exact += static_cast<double>(wr[c]) * xt[c];
        abs_sum += std::fabs(static_cast<double>(wr[c]) * xt[c]);
      }
      if (q8_path) {
        for (int64_t b = 0; b < cols / 32; ++b) {
          const double d = ad[t * (cols / 32) + b];
          double wabs = 0;
          for (int i = 0; i < 32; ++i) {
            const double xq = d * aq[t * cols + b * 32 + i];
            exact_q += wr[b * 32 + i] * xq;
            abs_sum_q += std::fabs(wr[b * 32 + i] * xq);
            wabs += std::fabs(wr[b * 32 + i]);
          }
          // Rounding x/d to an integer moves each x by at most d/2 (d = amax/127);
          // 0.501 absorbs the f32 rounding of d and 1/d.
          q8_bound += 0.501 * d * wabs;
        }
      }
      // f32 accumulation over `cols` terms, blocked sums: relative 1e-5 of sum |w x|
      // is ~100x the worst expected float error and far below any indexing bug.
      const double float_tol = 1e-5 * abs_sum + 1e-6;
      const double got = y[t * y_stride + r];
      if (q8_path) {
        ASSERT_NEAR(got, exact_q, 1e-5 * abs_sum_q + 1e-6) << "vs quantised x, t=" << t << " r=" << r;
        ASSERT_NEAR(got, exact, q8_bound + float_tol) << "vs exact x, t=" << t << " r=" << r;
      } else {
        ASSERT_NEAR(got, exact, float_tol) << "t=" << t << " r=" << r;
      }
    }
  }
}

TEST_P(CpuKernelsTest, MatMulMatchesReference) {
  std::mt19937 rng(42);
  const MatMulCase cases[] = {
      {GgmlType::kQ4_1, 7, 32},    {GgmlType::kQ4_1, 33, 96},   {GgmlType::kQ4_1, 64, 288},
      {GgmlType::kQ4_1, 130, 576}, {GgmlType::kQ8_0, 9, 64},    {GgmlType::kQ8_0, 67, 608},
      {GgmlType::kF32, 13, 37},    {GgmlType::kF32, 40, 264},   {GgmlType::kF16, 21, 100},
      {GgmlType::kBF16, 5, 72},    {GgmlType::kQ4_0, 18, 160},  {GgmlType::kQ4_K, 11, 512},
      {GgmlType::kQ6_K, 6, 256},   {GgmlType::kQ5_0, 10, 96},   {GgmlType::kQ5_K, 9, 768},
      {GgmlType::kQ4_K, 70, 256},  {GgmlType::kQ6_K, 21, 1280}, {GgmlType::kQ5_0, 12, 544},
      {GgmlType::kQ4_0, 9, 352},
  };
  for (const MatMulCase& mc : cases) {
    const TestWeights w = MakeWeights(rng, mc.type, mc.rows, mc.cols);
    for (int n_tokens : {1, 3, 17, 64}) {
      const std::vector<float> x = RandomVec(rng, n_tokens * mc.cols, -2.0f, 2.0f);
      for (MatMulPath path : {MatMulPath::kDot, MatMulPath::kSgemm, MatMulPath::kAuto}) {
        SCOPED_TRACE(::testing::Message() << gguf::TypeName(mc.type) << " " << mc.rows << "x" << mc.cols
                                          << " n_tokens=" << n_tokens << " path=" << static_cast<int>(path));
        // A padded output stride checks that y_stride is honoured and the pad untouched.
        const int64_t y_stride = mc.rows + 3;
        std::vector<float> y(static_cast<size_t>(n_tokens * y_stride), 1234.5f);
        ASSERT_TRUE(MatMul(w.view, x.data(), mc.cols, n_tokens, y.data(), y_stride, path).ok());
        const bool q8 =
            IsIntegerDotType(mc.type) &&
            (path == MatMulPath::kDot || (path == MatMulPath::kAuto && n_tokens < SgemmMinTokens()));
        CheckMatMul(w, x, n_tokens, y, y_stride, q8);
        for (int t = 0; t < n_tokens; ++t) {
          for (int64_t r = mc.rows; r < y_stride; ++r) ASSERT_EQ(y[t * y_stride + r], 1234.5f);
        }
      }
    }
  }
}

// The integer kernels of every GGUF type users deploy, on random shapes: several
// row counts (tails of the row tile), 1..17 tokens (tails of the token tile),
// block counts odd and even (the 512-bit VNNI tile takes two blocks at a time),
// weights from the reference quantiser and from random bytes.
TEST_P(CpuKernelsTest, IntegerDotMatMulMatchesReferenceForEveryType) {
  std::mt19937 rng(1234);
  struct TypeCase {
    GgmlType type;
    int64_t block;  // values per block of the format
  };
  const TypeCase types[] = {{GgmlType::kQ4_0, 32}, {GgmlType::kQ5_0, 32},  {GgmlType::kQ8_0, 32},
                            {GgmlType::kQ4_1, 32}, {GgmlType::kQ4_K, 256}, {GgmlType::kQ5_K, 256},
                            {GgmlType::kQ6_K, 256}};
  std::uniform_int_distribution<int> rows_dist(1, 23);
  for (const TypeCase& tc : types) {
    for (int shape = 0; shape < 4; ++shape) {
      const int64_t rows = shape == 0 ? 1 : rows_dist(rng);
      // 32-blocks: 1, 3 (odd), 18, 24 blocks; 256-blocks: 1, 2, 3, 6 super-blocks.
      const int64_t n_blocks = tc.block == 32 ? int64_t{std::array<int, 4>{1, 3, 18, 24}[shape]}
                                              : int64_t{std::array<int, 4>{1, 2, 3, 6}[shape]};
      const int64_t cols = n_blocks * tc.block;
      for (bool random_bytes : {false, true}) {
        const TestWeights w = random_bytes ? MakeRandomBlockWeights(rng, tc.type, rows, cols)
                                           : MakeWeights(rng, tc.type, rows, cols);
        for (int n_tokens = 1; n_tokens <= 17; n_tokens += (n_tokens < 6 ? 1 : 5)) {
          SCOPED_TRACE(::testing::Message() << gguf::TypeName(tc.type) << " " << rows << "x" << cols
                                            << " n_tokens=" << n_tokens << " random_bytes=" << random_bytes);
          const std::vector<float> x = RandomVec(rng, n_tokens * cols, -2.0f, 2.0f);
          const int64_t y_stride = rows + 1;
          std::vector<float> y(static_cast<size_t>(n_tokens * y_stride), 1234.5f);
          ASSERT_TRUE(MatMul(w.view, x.data(), cols, n_tokens, y.data(), y_stride, MatMulPath::kDot).ok());
          CheckMatMul(w, x, n_tokens, y, y_stride, /*q8_path=*/true);
          for (int t = 0; t < n_tokens; ++t) ASSERT_EQ(y[t * y_stride + rows], 1234.5f);
        }
      }
    }
  }
}

// y = MatMul's integer-dot route at `level`, y_ref the same at kScalar (then back
// at `level`): x [n_tokens][cols] against w.
void DotAtLevelAndScalar(CpuKernelLevel level, const TestWeights& w, const std::vector<float>& x,
                         int n_tokens, std::vector<float>* y, std::vector<float>* y_ref) {
  const int64_t rows = w.view.rows, cols = w.view.cols;
  y->assign(static_cast<size_t>(n_tokens * rows), 0.0f);
  y_ref->assign(y->size(), 0.0f);
  ASSERT_TRUE(SetCpuKernelLevel(level).ok());
  ASSERT_TRUE(MatMul(w.view, x.data(), cols, n_tokens, y->data(), rows, MatMulPath::kDot).ok());
  ASSERT_TRUE(SetCpuKernelLevel(CpuKernelLevel::kScalar).ok());
  ASSERT_TRUE(MatMul(w.view, x.data(), cols, n_tokens, y_ref->data(), rows, MatMulPath::kDot).ok());
  ASSERT_TRUE(SetCpuKernelLevel(level).ok());
}

// Every level's integer kernel against the scalar one on the same inputs (both use
// the same Q8 activations, so they differ only by f32 summation order).
TEST_P(CpuKernelsTest, IntegerDotLevelsAgreeWithScalar) {
  std::mt19937 rng(99);
  for (GgmlType type :
       {GgmlType::kQ4_0, GgmlType::kQ5_0, GgmlType::kQ4_K, GgmlType::kQ5_K, GgmlType::kQ6_K}) {
    const int64_t rows = 37, cols = 512;
    const TestWeights w = MakeRandomBlockWeights(rng, type, rows, cols);
    for (int n_tokens : {1, 5, 16}) {
      SCOPED_TRACE(::testing::Message() << gguf::TypeName(type) << " n_tokens=" << n_tokens);
      const std::vector<float> x = RandomVec(rng, n_tokens * cols, -2.0f, 2.0f);
      std::vector<float> y, y_ref;
      ASSERT_NO_FATAL_FAILURE(DotAtLevelAndScalar(GetParam(), w, x, n_tokens, &y, &y_ref));
      for (int64_t i = 0; i < n_tokens * rows; ++i) {
        double abs_sum = 0;  // sum |w x| of this output, the scale of f32 rounding
        const int t = static_cast<int>(i / rows);
        const int64_t r = i % rows;
        for (int64_t c = 0; c < cols; ++c)
          abs_sum += std::fabs(double{w.deq[r * cols + c]} * x[t * cols + c]);
        ASSERT_NEAR(y[i], y_ref[i], 1e-5 * abs_sum + 1e-6) << "t=" << t << " r=" << r;
      }
    }
  }
}

// Every level's kernels compute the scalar reference's arithmetic bit for bit (the
// integer dots are exact, the f32 steps the same fmas in the same order; see
// RunQuantRowsScalar), whichever of their paths a shape takes: wide 16-row groups
// (AVX-512), 8-row groups and the rows after the last group, the stored-layout
// tiles of 1-3 tokens and the packed tiles of 4 with their token tails,
// super-block and odd block counts. So a reply does not depend on whether the
// worker runs on an AVX2 or an AVX-512 machine.
TEST_P(CpuKernelsTest, IntegerDotEqualsScalarBitForBit) {
  std::mt19937 rng(5);
  std::uniform_int_distribution<int> rows_dist(1, 41);
  for (GgmlType type : {GgmlType::kQ4_0, GgmlType::kQ4_1, GgmlType::kQ5_0, GgmlType::kQ8_0, GgmlType::kQ4_K,
                        GgmlType::kQ5_K, GgmlType::kQ6_K}) {
    const int64_t block = gguf::GetTypeTraits(static_cast<uint32_t>(type))->block_size;
    for (int shape = 0; shape < 4; ++shape) {
      // 8: one group; 27: a wide group, a group of 8 and 3 single rows.
      const int64_t rows = std::array<int64_t, 4>{8, 27, rows_dist(rng), rows_dist(rng)}[shape];
      const int64_t cols = block * std::array<int64_t, 4>{1, 3, 5, 2}[shape];
      const TestWeights w = MakeRandomBlockWeights(rng, type, rows, cols);
      for (int n_tokens : {1, 2, 3, 4, 5, 7, 8, 16, 17, 19}) {
        SCOPED_TRACE(::testing::Message()
                     << gguf::TypeName(type) << " " << rows << "x" << cols << " n_tokens=" << n_tokens);
        const std::vector<float> x = RandomVec(rng, n_tokens * cols, -3.0f, 3.0f);
        std::vector<float> y, y_ref;
        ASSERT_NO_FATAL_FAILURE(DotAtLevelAndScalar(GetParam(), w, x, n_tokens, &y, &y_ref));
        for (size_t i = 0; i < y.size(); ++i) {
          ASSERT_EQ(y[i], y_ref[i]) << "t=" << i / rows << " r=" << i % rows;
        }
      }
    }
  }
}

// The interleaved layout (InterleaveRows16, what the CPU runner multiplies by) gives
// the scalar reference's result bit for bit, at every token count and through both
// entry points; rows after the last whole group of 16 take the stored layout.
TEST_P(CpuKernelsTest, InterleavedWeightsEqualScalarBitForBit) {
  std::mt19937 rng(31);
  for (GgmlType type : {GgmlType::kQ4_0, GgmlType::kQ4_1, GgmlType::kQ5_0, GgmlType::kQ8_0, GgmlType::kQ4_K,
                        GgmlType::kQ5_K, GgmlType::kQ6_K}) {
    const int64_t block = gguf::GetTypeTraits(static_cast<uint32_t>(type))->block_size;
    // 16 rows: one group; 45: two groups, a group of 8 and 5 single rows; 96 x 1536:
    // a down projection's row width.
    for (const auto& [rows, cols] :
         std::vector<std::pair<int64_t, int64_t>>{{16, block}, {45, 5 * block}, {96, 1536}}) {
      const TestWeights w = MakeRandomBlockWeights(rng, type, rows, cols);
      const std::vector<uint8_t> inter = InterleaveRows16(w.view);
      // Q4_K/Q5_K store their 6-bit scales as bytes: 64 more per group super-block.
      const int64_t extra =
          type == GgmlType::kQ4_K || type == GgmlType::kQ5_K ? rows / 16 * (cols / 256) * 64 : 0;
      ASSERT_EQ(static_cast<int64_t>(inter.size()), rows / 16 * 16 * *gguf::RowBytes(type, cols) + extra);
      ASSERT_NE(std::vector<uint8_t>(inter.begin(), inter.begin() + 64),
                std::vector<uint8_t>(w.bytes.begin(), w.bytes.begin() + 64))
          << "re-laid bytes equal the stored ones: the layout is not exercised";
      const KernelWeight kw(w.view, inter.data());
      // Up to 2^15 activation values each thread quantises its own copy; 24 tokens
      // of 1,536 are quantised once and shared by both threads (RunQuantProducts).
      for (int n_tokens : {1, 2, 3, 4, 5, 7, 8, 16, 17, 19, 24}) {
        SCOPED_TRACE(::testing::Message()
                     << gguf::TypeName(type) << " " << rows << "x" << cols << " n_tokens=" << n_tokens);
        const std::vector<float> x = RandomVec(rng, n_tokens * cols, -3.0f, 3.0f);
        std::vector<float> y(static_cast<size_t>(n_tokens * rows)), y_same(y.size()), y_ref(y.size());
        ASSERT_TRUE(MatMul(kw, x.data(), cols, n_tokens, y.data(), rows, MatMulPath::kDot).ok());
        const MatMulOutput same[] = {{kw, y_same.data()}};
        {
          const ScopedSgemmMinTokens dot_route(INT_MAX);  // the scalar level's default is sgemm
          ASSERT_TRUE(MatMulSameInput(same, x.data(), n_tokens).ok());
        }
        ASSERT_TRUE(SetCpuKernelLevel(CpuKernelLevel::kScalar).ok());
        ASSERT_TRUE(MatMul(w.view, x.data(), cols, n_tokens, y_ref.data(), rows, MatMulPath::kDot).ok());
        ASSERT_TRUE(SetCpuKernelLevel(GetParam()).ok());
        for (size_t i = 0; i < y.size(); ++i) {
          ASSERT_EQ(y[i], y_ref[i]) << "t=" << i / rows << " r=" << i % rows;
          ASSERT_EQ(y_same[i], y_ref[i]) << "MatMulSameInput t=" << i / rows << " r=" << i % rows;
        }
      }
    }
  }
}

// Every quant of every block set to `fill` (scales and mins as they are): the
// largest codes, against activations all at the quantisation's +-127, are where
// the vector kernels' int16 partial sums come closest to overflowing (kI16Steps,
// the offsets of the signed types, |q| of Q8_0's -128).
void FillQuants(GgmlType type, std::vector<uint8_t>* bytes, uint8_t fill) {
  // Each type's quants are one run of its block: [first, last).
  size_t first = 0, last = 0;
  switch (type) {
    case GgmlType::kQ4_0:
      first = offsetof(gguf::BlockQ4_0, qs), last = sizeof(gguf::BlockQ4_0);
      break;
    case GgmlType::kQ4_1:
      first = offsetof(gguf::BlockQ4_1, qs), last = sizeof(gguf::BlockQ4_1);
      break;
    case GgmlType::kQ5_0:  // qh, then qs
      first = offsetof(gguf::BlockQ5_0, qh), last = sizeof(gguf::BlockQ5_0);
      break;
    case GgmlType::kQ8_0:
      first = offsetof(gguf::BlockQ8_0, qs), last = sizeof(gguf::BlockQ8_0);
      break;
    case GgmlType::kQ4_K:
      first = offsetof(gguf::BlockQ4_K, qs), last = sizeof(gguf::BlockQ4_K);
      break;
    case GgmlType::kQ5_K:  // qh, then qs
      first = offsetof(gguf::BlockQ5_K, qh), last = sizeof(gguf::BlockQ5_K);
      break;
    case GgmlType::kQ6_K:  // ql, then qh, then the scales
      first = offsetof(gguf::BlockQ6_K, ql), last = offsetof(gguf::BlockQ6_K, scales);
      break;
    default:
      FAIL() << "no quant fields for " << gguf::TypeName(type);
  }
  const size_t block_bytes = gguf::TypeTraits(type).type_size;
  for (size_t off = 0; off < bytes->size(); off += block_bytes) {
    std::memset(bytes->data() + off + first, fill, last - first);
  }
}

TEST_P(CpuKernelsTest, ExtremeQuantsEqualScalarBitForBit) {
  std::mt19937 rng(77);
  for (GgmlType type : {GgmlType::kQ4_0, GgmlType::kQ4_1, GgmlType::kQ5_0, GgmlType::kQ8_0, GgmlType::kQ4_K,
                        GgmlType::kQ5_K, GgmlType::kQ6_K}) {
    // 0xFF: every code at its top (Q8_0: -1); 0x80: Q8_0's -128, and a top
    // nibble or bit pattern for the others; 0x7F: Q8_0's 127.
    for (uint8_t fill : {uint8_t{0xFF}, uint8_t{0x80}, uint8_t{0x7F}}) {
      // 32 rows: two interleaved groups; 45: two groups, a group of 8 and 5 single rows.
      for (int64_t rows : {32, 45}) {
        const int64_t cols = 512;
        TestWeights w = MakeRandomBlockWeights(rng, type, rows, cols);
        ASSERT_NO_FATAL_FAILURE(FillQuants(type, &w.bytes, fill));
        const std::vector<uint8_t> inter = InterleaveRows16(w.view);
        const KernelWeight kw(w.view, inter.data());
        for (float sign : {1.0f, -1.0f}) {
          for (int n_tokens : {1, 3, 4, 8, 16, 17}) {
            SCOPED_TRACE(::testing::Message() << gguf::TypeName(type) << " fill=" << int{fill} << " rows="
                                              << rows << " sign=" << sign << " n_tokens=" << n_tokens);
            const std::vector<float> x(static_cast<size_t>(n_tokens * cols), sign * 2.0f);
            std::vector<float> y(static_cast<size_t>(n_tokens * rows)), y_ref(y.size());
            ASSERT_TRUE(MatMul(kw, x.data(), cols, n_tokens, y.data(), rows, MatMulPath::kDot).ok());
            ASSERT_TRUE(SetCpuKernelLevel(CpuKernelLevel::kScalar).ok());
            ASSERT_TRUE(MatMul(w.view, x.data(), cols, n_tokens, y_ref.data(), rows, MatMulPath::kDot).ok());
            ASSERT_TRUE(SetCpuKernelLevel(GetParam()).ok());
            for (size_t i = 0; i < y.size(); ++i) {
              ASSERT_EQ(y[i], y_ref[i]) << "t=" << i / rows << " r=" << i % rows;
            }
          }
        }
      }
    }
  }
}

TEST(InterleaveRows16Test, EveryIntegerDotTypeInWholeGroups) {
  std::mt19937 rng(3);
  EXPECT_TRUE(InterleaveRows16(MakeRandomBlockWeights(rng, GgmlType::kQ4_1, 15, 64).view).empty());
  EXPECT_FALSE(InterleaveRows16(MakeRandomBlockWeights(rng, GgmlType::kQ4_1, 16, 64).view).empty());
  for (GgmlType type : {GgmlType::kQ4_0, GgmlType::kQ4_1, GgmlType::kQ5_0, GgmlType::kQ8_0, GgmlType::kQ4_K,
                        GgmlType::kQ5_K, GgmlType::kQ6_K}) {
    EXPECT_FALSE(InterleaveRows16(MakeRandomBlockWeights(rng, type, 16, 256).view).empty())
        << gguf::TypeName(type);
  }
  EXPECT_TRUE(InterleaveRows16(MakeWeights(rng, GgmlType::kF32, 32, 256).view).empty());
}

TEST(MatMulTypesTest, IntegerDotTypesAreTheDeployedQuants) {
  for (GgmlType t : {GgmlType::kQ4_0, GgmlType::kQ4_1, GgmlType::kQ5_0, GgmlType::kQ8_0, GgmlType::kQ4_K,
                     GgmlType::kQ5_K, GgmlType::kQ6_K}) {
    EXPECT_TRUE(IsIntegerDotType(t)) << gguf::TypeName(t);
  }
  for (GgmlType t : {GgmlType::kF32, GgmlType::kF16, GgmlType::kBF16, GgmlType::kQ5_1, GgmlType::kQ2_K}) {
    EXPECT_FALSE(IsIntegerDotType(t)) << gguf::TypeName(t);
  }
}

// What the runner's decode groups plan with: every vector level reads up to 16
// tokens straight from Q4_0, Q4_1 and Q8_0 groups, and avx2 unpacks the other
// types from 8 tokens on; no integer kernels, no shape.
TEST_P(CpuKernelsTest, MatMulTokenShapeByType) {
  for (GgmlType t : {GgmlType::kQ4_0, GgmlType::kQ4_1, GgmlType::kQ5_0, GgmlType::kQ8_0, GgmlType::kQ4_K,
                     GgmlType::kQ5_K, GgmlType::kQ6_K, GgmlType::kF32, GgmlType::kF16}) {
    SCOPED_TRACE(gguf::TypeName(t));
    const MatMulTokenShape shape = CurrentMatMulTokenShape(t);
    if (GetParam() == CpuKernelLevel::kScalar || !IsIntegerDotType(t)) {
      EXPECT_EQ(shape.tile_tokens, 0);
      EXPECT_EQ(shape.max_straight_tokens, 0);
      continue;
    }
    const bool avx2 = GetParam() == CpuKernelLevel::kAvx2;
    EXPECT_EQ(shape.tile_tokens, avx2 ? 4 : 8);
    const bool cheap_steps = t == GgmlType::kQ4_0 || t == GgmlType::kQ4_1 || t == GgmlType::kQ8_0;
    EXPECT_EQ(shape.max_straight_tokens, avx2 && !cheap_steps ? 7 : 16);
  }
}

TEST_P(CpuKernelsTest, MatMulSingleThreadEqualsMultiThread) {
  std::mt19937 rng(7);
  const TestWeights w = MakeWeights(rng, GgmlType::kQ4_1, 100, 576);
  const std::vector<float> x = RandomVec(rng, 5 * 576);
  std::vector<float> y1(5 * 100), y2(5 * 100);
  SetNumThreads(1);
  ASSERT_TRUE(MatMul(w.view, x.data(), 5, y1.data()).ok());
  SetNumThreads(2);
  ASSERT_TRUE(MatMul(w.view, x.data(), 5, y2.data()).ok());
  EXPECT_EQ(y1, y2);  // rows are independent: the split must not change any bit
  const TestWeights wk = MakeRandomBlockWeights(rng, GgmlType::kQ4_K, 200, 1024);
  const std::vector<float> xk = RandomVec(rng, 3 * 1024);
  std::vector<float> yk1(3 * 200), yk2(3 * 200);
  SetNumThreads(1);
  ASSERT_TRUE(MatMul(wk.view, xk.data(), 3, yk1.data()).ok());
  SetNumThreads(2);
  ASSERT_TRUE(MatMul(wk.view, xk.data(), 3, yk2.data()).ok());
  EXPECT_EQ(yk1, yk2);
}

// A token's outputs do not depend on the other tokens of the product: the engine
// batches decodes of different sessions and chunks prompts as load allows, and a
// seeded reply must come out the same either way. Every integer-dot type, odd
// batch sizes (vector lanes and scalar tails of every kernel), bit for bit.
TEST_P(CpuKernelsTest, IntegerDotTokenDoesNotDependOnTheBatch) {
  std::mt19937 rng(21);
  for (GgmlType type : {GgmlType::kQ4_0, GgmlType::kQ4_1, GgmlType::kQ5_0, GgmlType::kQ8_0, GgmlType::kQ4_K,
                        GgmlType::kQ5_K, GgmlType::kQ6_K}) {
    const int64_t rows = 21, cols = 768;
    const TestWeights w = MakeRandomBlockWeights(rng, type, rows, cols);
    const int n_tokens = 19;
    const std::vector<float> x = RandomVec(rng, n_tokens * cols, -2.0f, 2.0f);
    std::vector<float> all(static_cast<size_t>(n_tokens * rows));
    ASSERT_TRUE(MatMul(w.view, x.data(), cols, n_tokens, all.data(), rows, MatMulPath::kDot).ok());
    for (int batch : {1, 3, 8, 11}) {
      for (int t0 = 0; t0 < n_tokens; t0 += batch) {
        const int n = std::min(batch, n_tokens - t0);
        std::vector<float> part(static_cast<size_t>(n * rows));
        ASSERT_TRUE(MatMul(w.view, x.data() + t0 * cols, cols, n, part.data(), rows, MatMulPath::kDot).ok());
        for (int64_t i = 0; i < n * rows; ++i) {
          ASSERT_EQ(part[i], all[t0 * rows + i]) << gguf::TypeName(type) << " batch " << batch << " token "
                                                 << t0 + i / rows << " row " << i % rows;
        }
      }
    }
  }
}

// Products sharing their input (a layer's q/k/v, gate/up) equal MatMul's bit for
// bit, whether they run fused (integer-dot types) or one by one (f32 among them).
TEST_P(CpuKernelsTest, MatMulSameInputEqualsMatMul) {
  std::mt19937 rng(5);
  const int64_t cols = 512;
  const TestWeights a = MakeRandomBlockWeights(rng, GgmlType::kQ4_K, 40, cols);
  const TestWeights b = MakeRandomBlockWeights(rng, GgmlType::kQ6_K, 17, cols);
  const TestWeights c = MakeWeights(rng, GgmlType::kQ4_1, 9, cols);
  const TestWeights f = MakeWeights(rng, GgmlType::kF32, 6, cols);
  const TestWeights q8 = MakeRandomBlockWeights(rng, GgmlType::kQ8_0, 33, cols);
  // Interleaved copies (what the runner multiplies by): Q6_K and Q8_0 tiles read
  // offset weights, each with its own start values in one call (QuantJob::aot).
  const std::vector<uint8_t> ia = InterleaveRows16(a.view), ib = InterleaveRows16(b.view),
                             iq8 = InterleaveRows16(q8.view);
  const KernelWeight ka(a.view, ia.data()), kb(b.view, ib.data()), kq8(q8.view, iq8.data());
  for (int n_tokens : {1, 5, 8, 16, 19}) {
    SCOPED_TRACE(::testing::Message() << "n_tokens=" << n_tokens);
    const std::vector<float> x = RandomVec(rng, n_tokens * cols, -2.0f, 2.0f);
    for (int set = 0; set < 3; ++set) {
      std::vector<KernelWeight> ws = {a.view, b.view, c.view};
      if (set == 1) ws.push_back(f.view);
      if (set == 2) ws = {ka, kq8, kb, c.view};
      std::vector<std::vector<float>> fused(ws.size()), alone(ws.size());
      std::vector<MatMulOutput> outs;
      for (size_t i = 0; i < ws.size(); ++i) {
        fused[i].assign(static_cast<size_t>(n_tokens * ws[i].view.rows), -1.0f);
        alone[i].resize(fused[i].size());
        outs.push_back({ws[i], fused[i].data()});
        ASSERT_TRUE(MatMul(ws[i], x.data(), n_tokens, alone[i].data()).ok());
      }
      ASSERT_TRUE(MatMulSameInput(outs, x.data(), n_tokens).ok());
      for (size_t i = 0; i < ws.size(); ++i)
        EXPECT_EQ(fused[i], alone[i]) << "set " << set << " product " << i;
    }
  }
  // Products of different widths cannot share an input.
  const TestWeights narrow = MakeWeights(rng, GgmlType::kQ4_1, 4, 256);
  std::vector<float> y1(40), y2(4);
  const std::vector<float> x = RandomVec(rng, cols);
  const MatMulOutput mixed[] = {{a.view, y1.data()}, {narrow.view, y2.data()}};
  EXPECT_EQ(MatMulSameInput(mixed, x.data(), 1).code(), absl::StatusCode::kInvalidArgument);
}

TEST_P(CpuKernelsTest, QuantizeActivationsQ8Bounds) {
  std::mt19937 rng(3);
  std::vector<float> x = RandomVec(rng, 2 * 96, -3.0f, 3.0f);
  std::fill(x.begin() + 32, x.begin() + 64, 0.0f);  // an all-zero block
  std::vector<int8_t> q(2 * 96);
  std::vector<float> d(6), s(6);
  QuantizeActivationsQ8(x.data(), 96, 2, 96, q.data(), d.data(), s.data());
  for (int b = 0; b < 6; ++b) {
    float amax = 0;
    int sum = 0;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[b * 32 + i]));
    EXPECT_FLOAT_EQ(d[b], amax / 127.0f);
    for (int i = 0; i < 32; ++i) {
      EXPECT_LE(std::abs(q[b * 32 + i]), 127);
      EXPECT_NEAR(x[b * 32 + i], d[b] * q[b * 32 + i], 0.501 * d[b] + 1e-7);
      sum += q[b * 32 + i];
    }
    EXPECT_FLOAT_EQ(s[b], d[b] * static_cast<float>(sum));
  }
  EXPECT_EQ(d[1], 0.0f);
}

// The vector quantisers (8 blocks at a time, then the rest) give the scalar
// kernel's q, d and s bit for bit, for every block count up to two groups and a
// tail, with all-zero blocks, tiny and huge magnitudes, and exact .5 products.
TEST_P(CpuKernelsTest, QuantizeActivationsQ8EqualsScalarBitForBit) {
  std::mt19937 rng(17);
  for (int64_t nb = 1; nb <= 19; ++nb) {
    const int64_t cols = nb * 32;
    const int n_tokens = 3;
    std::vector<float> x = RandomVec(rng, n_tokens * cols, -3.0f, 3.0f);
    for (int64_t b = 0; b < n_tokens * nb; ++b) {
      float* blk = x.data() + b * 32;
      switch (rng() % 6) {
        case 0:
          std::fill(blk, blk + 32, 0.0f);
          break;
        case 1:
          for (int i = 0; i < 32; ++i) blk[i] *= 1e-30f;
          break;
        case 2:
          for (int i = 0; i < 32; ++i) blk[i] *= 1e30f;
          break;
        case 3:  // max 127: every other value lands on a .5 (ties to even)
          for (int i = 0; i < 32; ++i) blk[i] = static_cast<float>(static_cast<int>(rng() % 255) - 127) / 2;
          blk[rng() % 32] = -127.0f;
          break;
        default:
          break;
      }
    }
    SCOPED_TRACE(::testing::Message() << "blocks=" << nb);
    const int64_t n = n_tokens * cols, nbs = n_tokens * nb;
    std::vector<int8_t> q(n), q_ref(n);
    std::vector<float> d(nbs), s(nbs), d_ref(nbs), s_ref(nbs);
    QuantizeActivationsQ8(x.data(), cols, n_tokens, cols, q.data(), d.data(), s.data());
    ASSERT_TRUE(SetCpuKernelLevel(CpuKernelLevel::kScalar).ok());
    QuantizeActivationsQ8(x.data(), cols, n_tokens, cols, q_ref.data(), d_ref.data(), s_ref.data());
    ASSERT_TRUE(SetCpuKernelLevel(GetParam()).ok());
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(q[i], q_ref[i]) << "i=" << i;
    for (int64_t b = 0; b < nbs; ++b) {
      ASSERT_EQ(d[b], d_ref[b]) << "b=" << b;
      ASSERT_EQ(s[b], s_ref[b]) << "b=" << b;
    }
  }
}

TEST_P(CpuKernelsTest, MatMulRejectsBadInput) {
  std::vector<uint8_t> bytes(1024);
  std::vector<float> x(64), y(64);
  WeightView w{GgmlType::kQ4_1, bytes.data(), 2, 48};  // 48 is not a whole number of blocks
  EXPECT_EQ(MatMul(w, x.data(), 1, y.data()).code(), absl::StatusCode::kInvalidArgument);
  w.cols = 32;
  EXPECT_EQ(MatMul(w, x.data(), 16, 1, y.data(), 2).code(), absl::StatusCode::kInvalidArgument);
  w.type = GgmlType::kQ2_K;  // known to ggml, not decodable here
  w.cols = 256;
  EXPECT_EQ(MatMul(w, x.data(), 0, y.data()).code(), absl::StatusCode::kUnimplemented);
  w.type = static_cast<GgmlType>(4);  // not a ggml type at all
  EXPECT_EQ(MatMul(w, x.data(), 1, y.data()).code(), absl::StatusCode::kInvalidArgument);
}

// ---------------------------------------------------------------- ops

TEST_P(CpuKernelsTest, RmsNorm) {
  std::mt19937 rng(11);
  for (int64_t n : {1, 7, 64, 576, 1001}) {
    const int n_tokens = 3;
    const std::vector<float> x = RandomVec(rng, n_tokens * n, -4.0f, 4.0f);
    const std::vector<float> w = RandomVec(rng, n);
    std::vector<float> y(x.size());
    RmsNorm(x.data(), w.data(), n_tokens, n, 1e-5f, y.data());
    for (int t = 0; t < n_tokens; ++t) {
      double ss = 0;
      for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(x[t * n + i]) * x[t * n + i];
      const double scale = 1.0 / std::sqrt(ss / n + 1e-5);
      for (int64_t i = 0; i < n; ++i) {
        const double ref = x[t * n + i] * scale * w[i];
        ASSERT_NEAR(y[t * n + i], ref, 2e-6 * std::fabs(ref) + 1e-7) << n << " " << i;
      }
    }
    std::vector<float> inplace = x;  // y == x is allowed
    RmsNorm(inplace.data(), w.data(), n_tokens, n, 1e-5f, inplace.data());
    EXPECT_EQ(inplace, y);
  }
}

TEST_P(CpuKernelsTest, SwiGluAddSoftmax) {
  std::mt19937 rng(12);
  for (int64_t n : {1, 9, 1536, 1541}) {
    const std::vector<float> g = RandomVec(rng, n, -20.0f, 20.0f);
    const std::vector<float> u = RandomVec(rng, n, -3.0f, 3.0f);
    std::vector<float> out(static_cast<size_t>(n));
    SwiGlu(g.data(), u.data(), n, out.data());
    for (int64_t i = 0; i < n; ++i) {
      const double ref = g[i] / (1.0 + std::exp(-static_cast<double>(g[i]))) * u[i];
      // Vector exp is accurate to ~2e-7 relative; the division and product add ~1e-7.
      ASSERT_NEAR(out[i], ref, 1e-6 * std::fabs(ref) + 1e-7) << i;
    }
    SwiGlu(g.data(), u.data(), n, out.data());
    Add(g.data(), u.data(), n, out.data());
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(out[i], g[i] + u[i]);

    std::vector<float> sm = RandomVec(rng, 2 * n, -30.0f, 30.0f);
    const std::vector<float> orig = sm;
    Softmax(sm.data(), 2, n);
    for (int r = 0; r < 2; ++r) {
      double m = -INFINITY, sum = 0;
      for (int64_t i = 0; i < n; ++i) m = std::max<double>(m, orig[r * n + i]);
      for (int64_t i = 0; i < n; ++i) sum += std::exp(orig[r * n + i] - m);
      for (int64_t i = 0; i < n; ++i) {
        const double ref = std::exp(orig[r * n + i] - m) / sum;
        ASSERT_NEAR(sm[r * n + i], ref, 1e-6 * ref + 1e-9);
      }
    }
  }
  // Long enough for SwiGlu to split over the pool (chunks of 4096): each element
  // as a call over its chunk alone computes it, and close to the reference.
  const int64_t n = 3 * 4096 + 37;
  const std::vector<float> g = RandomVec(rng, n, -20.0f, 20.0f);
  const std::vector<float> u = RandomVec(rng, n, -3.0f, 3.0f);
  std::vector<float> out(static_cast<size_t>(n)), piece(4096);
  SwiGlu(g.data(), u.data(), n, out.data());
  for (int64_t i0 = 0; i0 < n; i0 += 4096) {
    const int64_t len = std::min<int64_t>(4096, n - i0);
    SwiGlu(g.data() + i0, u.data() + i0, len, piece.data());
    for (int64_t i = 0; i < len; ++i) ASSERT_EQ(out[i0 + i], piece[i]) << i0 + i;
  }
  for (int64_t i = 0; i < n; ++i) {
    const double ref = g[i] / (1.0 + std::exp(-static_cast<double>(g[i]))) * u[i];
    ASSERT_NEAR(out[i], ref, 1e-6 * std::fabs(ref) + 1e-7) << i;
  }
  // AVX-512 gives AVX2's bits (the same exp polynomial and division lane by lane;
  // n % 16 != 0, so a tail too), down to signed zeros and the exp clamps: a reply
  // does not depend on which of the two levels a machine has.
  if (GetParam() == CpuKernelLevel::kAvx512) {
    std::vector<float> gs = g;
    const float special[] = {0.0f, -0.0f, 1e-30f, -1e-30f, 88.0f, 89.0f, -88.5f, -100.0f, 1e30f, -1e30f};
    std::copy(std::begin(special), std::end(special), gs.begin());
    SwiGlu(gs.data(), u.data(), n, out.data());
    std::vector<float> at_avx2(out.size());
    ASSERT_TRUE(SetCpuKernelLevel(CpuKernelLevel::kAvx2).ok());
    SwiGlu(gs.data(), u.data(), n, at_avx2.data());
    ASSERT_TRUE(SetCpuKernelLevel(CpuKernelLevel::kAvx512).ok());
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(absl::bit_cast<uint32_t>(out[i]), absl::bit_cast<uint32_t>(at_avx2[i])) << i << " " << gs[i];
    }
  }
}

TEST_P(CpuKernelsTest, GetRows) {
  std::mt19937 rng(13);
  for (GgmlType type : {GgmlType::kQ8_0, GgmlType::kF16, GgmlType::kQ4_1, GgmlType::kF32}) {
    const TestWeights table = MakeWeights(rng, type, 50, 96);
    const std::vector<int32_t> ids = {0, 49, 17, 17};
    std::vector<float> out(ids.size() * 96);
    ASSERT_TRUE(GetRows(table.view, ids, out.data()).ok());
    for (size_t i = 0; i < ids.size(); ++i) {
      for (int c = 0; c < 96; ++c) ASSERT_EQ(out[i * 96 + c], table.deq[ids[i] * 96 + c]);
    }
    const std::vector<int32_t> bad = {3, 50};
    EXPECT_EQ(GetRows(table.view, bad, out.data()).code(), absl::StatusCode::kInvalidArgument);
    const std::vector<int32_t> negative = {-1};
    EXPECT_EQ(GetRows(table.view, negative, out.data()).code(), absl::StatusCode::kInvalidArgument);
  }
}

TEST_P(CpuKernelsTest, RopeRotatesAdjacentPairs) {
  // head_dim 4, position 1, base 1e4: pair 0 turns by 1 rad, pair 1 by 0.01 rad, and
  // the pairs are (x0, x1), (x2, x3) (llama NORM), not (x0, x2) (NEOX).
  auto table = RopeTable::Create({4, 10000.0f, 1.0f, false, {}}, 8);
  ASSERT_TRUE(table.ok());
  float x[4] = {1.0f, 0.0f, 0.0f, 1.0f};
  const int32_t pos[] = {1};
  ASSERT_TRUE(table->Apply(x, 1, 1, pos).ok());
  EXPECT_NEAR(x[0], std::cos(1.0), 1e-6);
  EXPECT_NEAR(x[1], std::sin(1.0), 1e-6);
  EXPECT_NEAR(x[2], -std::sin(0.01), 1e-6);
  EXPECT_NEAR(x[3], std::cos(0.01), 1e-6);
}

TEST_P(CpuKernelsTest, RopeMatchesReference) {
  std::mt19937 rng(14);
  for (int head_dim : {64, 128, 6}) {
    for (float freq_scale : {1.0f, 0.25f}) {
      const float base = 100000.0f;
      auto table = RopeTable::Create({head_dim, base, freq_scale, false, {}}, 5000);
      ASSERT_TRUE(table.ok());
      const int n_tokens = 5, n_heads = 3;
      const std::vector<int32_t> pos = {0, 1, 17, 4095, 4999};
      std::vector<float> x = RandomVec(rng, n_tokens * n_heads * head_dim);
      const std::vector<float> orig = x;
      ASSERT_TRUE(table->Apply(x.data(), n_tokens, n_heads, pos).ok());
      for (int t = 0; t < n_tokens; ++t) {
        for (int h = 0; h < n_heads; ++h) {
          for (int i = 0; i < head_dim / 2; ++i) {
            const double theta = pos[t] * static_cast<double>(freq_scale) *
                                 std::pow(static_cast<double>(base), -2.0 * i / head_dim);
            const size_t o = (static_cast<size_t>(t) * n_heads + h) * head_dim + 2 * i;
            const double x0 = orig[o], x1 = orig[o + 1];
            // Table entries are f32-rounded cos/sin (error 6e-8), then two products.
            ASSERT_NEAR(x[o], x0 * std::cos(theta) - x1 * std::sin(theta), 3e-7);
            ASSERT_NEAR(x[o + 1], x0 * std::sin(theta) + x1 * std::cos(theta), 3e-7);
          }
        }
      }
      const std::vector<int32_t> bad = {5000};
      EXPECT_EQ(table->Apply(x.data(), 1, n_heads, bad).code(), absl::StatusCode::kInvalidArgument);
    }
  }
  EXPECT_FALSE(RopeTable::Create({63, 10000.0f, 1.0f, false, {}}, 8).ok());
}

// ---------------------------------------------------------------- KV + attention

float RoundTo(KvDtype dtype, float v) {
  switch (dtype) {
    case KvDtype::kF16:
      return gguf::Fp16ToFp32(gguf::Fp32ToFp16(v));
    case KvDtype::kBF16:
      return gguf::Bf16ToFp32(gguf::Fp32ToBf16(v));
    case KvDtype::kF32:
      return v;
  }
  return v;
}

float ReadElt(const PageLayout& L, const uint8_t* p) {
  if (L.dtype == KvDtype::kF32) {
    float f;
    std::memcpy(&f, p, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, p, 2);
  return L.dtype == KvDtype::kF16 ? gguf::Fp16ToFp32(h) : gguf::Bf16ToFp32(h);
}

TEST_P(CpuKernelsTest, WriteKvPlacesRowsPerLayout) {
  std::mt19937 rng(21);
  for (KvDtype dtype : {KvDtype::kF16, KvDtype::kF32, KvDtype::kBF16}) {
    PageLayout L{3, 2, 40, 4, dtype};  // head_dim 40: not a multiple of 16
    std::vector<uint8_t> slab(static_cast<size_t>(6 * L.page_bytes()), 0xAB);
    const std::vector<int32_t> pages = {4, 1, 5};
    const int first = 2, n = 9, layer = 1;
    const std::vector<float> k = RandomVec(rng, n * L.row_elems());
    const std::vector<float> v = RandomVec(rng, n * L.row_elems());
    ASSERT_TRUE(WriteKv(L, slab.data(), pages, layer, first, n, k.data(), v.data()).ok());
    size_t written = 0;
    for (int t = 0; t < n; ++t) {
      const int pos = first + t;
      const uint8_t* page = slab.data() + pages[pos / 4] * L.page_bytes();
      for (int e = 0; e < L.row_elems(); ++e) {
        ASSERT_EQ(ReadElt(L, page + L.k_offset(layer, pos % 4) + e * L.elt_bytes()),
                  RoundTo(dtype, k[t * L.row_elems() + e]));
        ASSERT_EQ(ReadElt(L, page + L.v_offset(layer, pos % 4) + e * L.elt_bytes()),
                  RoundTo(dtype, v[t * L.row_elems() + e]));
        written += 2 * L.elt_bytes();
      }
    }
    // Nothing else changed.
    size_t untouched = 0;
    for (uint8_t b : slab) untouched += b == 0xAB;
    EXPECT_GE(untouched, slab.size() - written);
    EXPECT_EQ(WriteKv(L, slab.data(), pages, layer, 10, 3, k.data(), v.data()).code(),
              absl::StatusCode::kInvalidArgument);  // position 12 needs a 4th page
    EXPECT_EQ(WriteKv(L, slab.data(), pages, 3, 0, 1, k.data(), v.data()).code(),
              absl::StatusCode::kInvalidArgument);
  }
}

struct AttnCase {
  int n_heads, kv_heads, head_dim, page_tokens, window;
  KvDtype dtype;
  std::vector<std::pair<int, int>> seqs;  // (n_cached, n_query)
};

void RunAttentionCase(const AttnCase& ac, std::mt19937& rng) {
  PageLayout L{2, ac.kv_heads, ac.head_dim, ac.page_tokens, ac.dtype};
  const int layer = 1;
  int total_pages = 0;
  for (auto [n_cached, n_query] : ac.seqs) total_pages += (n_cached + ac.page_tokens - 1) / ac.page_tokens;
  std::vector<uint8_t> slab(static_cast<size_t>((total_pages + 1) * L.page_bytes()));
  // Pages of all sequences interleaved in a shuffled order.
  std::vector<int32_t> ids(total_pages);
  std::iota(ids.begin(), ids.end(), 1);
  std::shuffle(ids.begin(), ids.end(), rng);
  std::vector<std::vector<int32_t>> tables;
  std::vector<std::vector<float>> ks, vs;  // per sequence [n_cached][kv_heads][head_dim]
  std::vector<AttentionSeq> seqs;
  int next = 0, total_q = 0;
  for (auto [n_cached, n_query] : ac.seqs) {
    const int np = (n_cached + ac.page_tokens - 1) / ac.page_tokens;
    tables.emplace_back(ids.begin() + next, ids.begin() + next + np);
    next += np;
    ks.push_back(RandomVec(rng, n_cached * L.row_elems(), -2.0f, 2.0f));
    vs.push_back(RandomVec(rng, n_cached * L.row_elems()));
    // Written in two calls, as a prefix then a step would.
    const int split = n_cached / 3;
    ASSERT_TRUE(
        WriteKv(L, slab.data(), tables.back(), layer, 0, split, ks.back().data(), vs.back().data()).ok());
    ASSERT_TRUE(WriteKv(L, slab.data(), tables.back(), layer, split, n_cached - split,
                        ks.back().data() + split * L.row_elems(), vs.back().data() + split * L.row_elems())
                    .ok());
    total_q += n_query;
  }
  for (size_t s = 0; s < ac.seqs.size(); ++s) {
    seqs.push_back({tables[s], ac.seqs[s].first, ac.seqs[s].second});
  }
  const int hd = ac.head_dim, G = ac.n_heads / ac.kv_heads;
  const std::vector<float> q = RandomVec(rng, total_q * ac.n_heads * hd, -1.0f, 1.0f);
  std::vector<float> out(q.size(), NAN);
  AttentionParams p;
  p.layout = L;
  p.kv_base = slab.data();
  p.layer = layer;
  p.n_heads = ac.n_heads;
  p.sliding_window = ac.window;
  ASSERT_TRUE(PagedAttention(p, seqs, q.data(), out.data()).ok());

  int row = 0;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  for (size_t s = 0; s < ac.seqs.size(); ++s) {
    const auto [n_cached, n_query] = ac.seqs[s];
    for (int i = 0; i < n_query; ++i, ++row) {
      const int pos = n_cached - n_query + i;
      const int lo = ac.window > 0 ? std::max(0, pos - ac.window + 1) : 0;
      for (int h = 0; h < ac.n_heads; ++h) {
        const int kvh = h / G;
        const float* qh = q.data() + (static_cast<size_t>(row) * ac.n_heads + h) * hd;
        std::vector<double> sc(pos + 1, 0.0);
        double m = -INFINITY;
        for (int j = lo; j <= pos; ++j) {
          double d = 0;
          for (int e = 0; e < hd; ++e) {
            d += qh[e] * static_cast<double>(
                             RoundTo(ac.dtype, ks[s][(static_cast<size_t>(j) * ac.kv_heads + kvh) * hd + e]));
          }
          sc[j] = d * scale;
          m = std::max(m, sc[j]);
        }
        double l = 0;
        for (int j = lo; j <= pos; ++j) l += std::exp(sc[j] - m);
        for (int e = 0; e < hd; ++e) {
          double o = 0;
          for (int j = lo; j <= pos; ++j) {
            o += std::exp(sc[j] - m) / l *
                 RoundTo(ac.dtype, vs[s][(static_cast<size_t>(j) * ac.kv_heads + kvh) * hd + e]);
          }
          // |V| <= 1 and the output is a convex combination of V rows: f32 scores,
          // vector exp (2e-7) and f32 accumulation over <= 1k keys stay below 2e-5.
          ASSERT_NEAR(out[(static_cast<size_t>(row) * ac.n_heads + h) * hd + e], o, 2e-5)
              << "seq " << s << " query " << i << " head " << h << " dim " << e;
        }
      }
    }
  }
}

TEST_P(CpuKernelsTest, PagedAttentionMatchesReference) {
  std::mt19937 rng(31);
  const std::vector<AttnCase> cases = {
      // SmolLM2 shape: GQA group 3; a batch of decodes of mixed lengths incl. partial pages.
      {9, 3, 64, 16, 0, KvDtype::kF16, {{1, 1}, {15, 1}, {16, 1}, {17, 1}, {700, 1}, {33, 1}}},
      // One long decode alone (split into key ranges and merged).
      {9, 3, 64, 16, 0, KvDtype::kF16, {{1100, 1}}},
      // Prefill from empty and a chunked prefill after a cached prefix, with a decode.
      {9, 3, 64, 16, 0, KvDtype::kF16, {{40, 40}, {75, 23}, {9, 1}}},
      // head_dim 128, MHA (group 1), f32 KV, odd page size.
      {4, 4, 128, 5, 0, KvDtype::kF32, {{23, 23}, {301, 2}}},
      // Group 8, bf16.
      {16, 2, 64, 16, 0, KvDtype::kBF16, {{50, 50}, {300, 1}}},
      // MQA (one kv head) and a sliding window, prefill + decode.
      {8, 1, 128, 16, 37, KvDtype::kF16, {{90, 90}, {600, 1}, {64, 7}}},
      // Window larger than the sequence; head_dim not a multiple of 8 (scalar path).
      {6, 3, 20, 4, 1000, KvDtype::kF16, {{30, 30}, {11, 1}}},
      // head_dim 32, group 4, bf16, pages of 12 (blocks of 8 and 16 end short at page ends):
      // decodes of 1..250 keys, a prefill and a chunk.
      {8, 2, 32, 12, 0, KvDtype::kBF16, {{1, 1}, {7, 1}, {12, 1}, {13, 1}, {29, 29}, {100, 5}, {250, 1}}},
      // head_dim 32, MHA, f32, pages of 7, a window of 19 that starts inside blocks.
      {3, 3, 32, 7, 19, KvDtype::kF32, {{130, 9}, {20, 20}, {500, 1}}},
      // Split key ranges that start mid-page (window 700, pages of 12), group 3.
      {9, 3, 64, 12, 700, KvDtype::kF16, {{1500, 1}, {1000, 2}}},
      // head_dim 128, group 4 (Llama 3), pages of 13: a 3-token query split into key ranges.
      {8, 2, 128, 13, 0, KvDtype::kF16, {{900, 3}, {31, 1}}},
      {8, 2, 128, 13, 0, KvDtype::kBF16, {{700, 2}}},
  };
  for (int threads : {1, 2}) {
    SetNumThreads(threads);
    for (size_t c = 0; c < cases.size(); ++c) {
      SCOPED_TRACE(::testing::Message() << "case " << c << " threads " << threads);
      RunAttentionCase(cases[c], rng);
    }
  }
}

// Every head_dim a block path takes (multiples of 8 up to 128: each AVX2 and
// AVX-512 instantiation, every P·V column remainder), with groups 1..5 (every
// tail of rows per P·V call), each KV dtype, odd page sizes and a window.
TEST_P(CpuKernelsTest, PagedAttentionEveryHeadDim) {
  std::mt19937 rng(47);
  const KvDtype dtypes[] = {KvDtype::kF16, KvDtype::kBF16, KvDtype::kF32};
  for (int hd = 8; hd <= 128; hd += 8) {
    const int i = hd / 8, group = 1 + i % 5, kv_heads = 1 + i % 2;
    const int page_tokens = 3 + 2 * (i % 6);  // 3..13
    const int window = i % 3 == 0 ? 11 : 0;
    const AttnCase ac{
        group * kv_heads, kv_heads, hd, page_tokens, window, dtypes[i % 3], {{37, 37}, {90, 1}, {20, 3}}};
    SCOPED_TRACE(::testing::Message() << "head_dim " << hd << " group " << group << " page " << ac.page_tokens
                                      << " window " << ac.window);
    RunAttentionCase(ac, rng);
  }
}

// The shape of the bit-for-bit attention tests below.
struct RowShape {
  int n_heads, kv_heads, head_dim, page_tokens, window;
  KvDtype dtype;
};

// One layer of `keys` random keys in shuffled pages, and the params that read it.
struct RandomLayer {
  std::vector<uint8_t> slab;
  std::vector<int32_t> table;
  AttentionParams params;
};

absl::Status FillRandomLayer(const RowShape& sh, int keys, std::mt19937& rng, RandomLayer* out) {
  const PageLayout L{1, sh.kv_heads, sh.head_dim, sh.page_tokens, sh.dtype};
  const int n_pages = (keys + sh.page_tokens - 1) / sh.page_tokens;
  out->slab.assign(static_cast<size_t>((n_pages + 1) * L.page_bytes()), 0);
  out->table.resize(n_pages);
  std::iota(out->table.begin(), out->table.end(), 1);
  std::shuffle(out->table.begin(), out->table.end(), rng);
  const std::vector<float> k = RandomVec(rng, int64_t{keys} * L.row_elems(), -2.0f, 2.0f);
  const std::vector<float> v = RandomVec(rng, int64_t{keys} * L.row_elems());
  out->params = AttentionParams();
  out->params.layout = L;
  out->params.kv_base = out->slab.data();
  out->params.n_heads = sh.n_heads;
  out->params.sliding_window = sh.window;
  return WriteKv(L, out->slab.data(), out->table, 0, 0, keys, k.data(), v.data());
}

// A query row's output does not depend on how many query tokens came with it:
// a decode token and the same position as the last token of a chunk give the
// same bits (a worker that chunks a prompt differently, under memory pressure,
// still samples what a roomy one samples). Past 512 keys,
// PagedAttentionRowDoesNotDependOnTheBatch checks the split ranges.
TEST_P(CpuKernelsTest, PagedAttentionRowDoesNotDependOnItsChunk) {
  std::mt19937 rng(53);
  const RowShape shapes[] = {
      {9, 3, 64, 16, 0, KvDtype::kF16},   // SmolLM2: groups of 3
      {4, 2, 128, 5, 0, KvDtype::kBF16},  // groups of 2, odd pages
      {4, 4, 32, 3, 19, KvDtype::kF32},   // MHA, pages shorter than a block, a window
      {8, 2, 64, 16, 0, KvDtype::kF16},   // groups of 4
  };
  for (int threads : {1, 2}) {
    SetNumThreads(threads);
    for (const RowShape& sh : shapes) {
      for (int n_cached : {1, 7, 100, 511}) {
        SCOPED_TRACE(::testing::Message() << "heads " << sh.n_heads << "/" << sh.kv_heads << " head_dim "
                                          << sh.head_dim << " keys " << n_cached << " threads " << threads);
        RandomLayer kv;
        ASSERT_TRUE(FillRandomLayer(sh, n_cached, rng, &kv).ok());
        const std::vector<int32_t>& table = kv.table;
        const AttentionParams& p = kv.params;
        // The decode token's output is the reference for the last row of each chunk.
        const int row = sh.n_heads * sh.head_dim;
        const std::vector<float> last_q = RandomVec(rng, row, -1.0f, 1.0f);
        std::vector<float> want(row, NAN);
        ASSERT_TRUE(PagedAttention(p, {{table, n_cached, 1}}, last_q.data(), want.data()).ok());
        for (int n_query : {2, 5, 9}) {
          if (n_query > n_cached) continue;
          std::vector<float> q = RandomVec(rng, n_query * row, -1.0f, 1.0f);
          std::copy(last_q.begin(), last_q.end(), q.end() - row);
          std::vector<float> out(q.size(), NAN);
          ASSERT_TRUE(PagedAttention(p, {{table, n_cached, n_query}}, q.data(), out.data()).ok());
          EXPECT_EQ(std::memcmp(out.data() + (n_query - 1) * row, want.data(), row * sizeof(float)), 0)
              << n_query << " query tokens";
        }
      }
    }
  }
}

// A query row's output is the same bits whatever else its call computes: the
// same row decoded alone, beside other sequences (short and long, which used
// to change how its key range was split), as the last row of a prefill chunk,
// and on 1, 2 or 3 threads. Greedy replies then do not change with what else
// the worker runs, and an APPEND conversation equals the same tokens sent as
// one FULL_CONTEXT request (a black-box test saw them differ past ~500 tokens).
TEST_P(CpuKernelsTest, PagedAttentionRowDoesNotDependOnTheBatch) {
  std::mt19937 rng(59);
  const RowShape shapes[] = {
      {9, 3, 64, 16, 0, KvDtype::kF16},    // SmolLM2
      {4, 2, 128, 5, 0, KvDtype::kBF16},   // odd pages
      {4, 4, 32, 3, 700, KvDtype::kF32},   // MHA, short pages, a window
      {8, 2, 64, 16, 300, KvDtype::kF16},  // groups of 4, a window
  };
  constexpr int kMaxKeys = 2100;
  for (const RowShape& sh : shapes) {
    RandomLayer kv;
    ASSERT_TRUE(FillRandomLayer(sh, kMaxKeys, rng, &kv).ok());
    const std::vector<int32_t>& table = kv.table;
    const AttentionParams& p = kv.params;
    const int row = sh.n_heads * sh.head_dim;
    for (int n_cached : {300, 700, 1500}) {
      SCOPED_TRACE(::testing::Message() << "heads " << sh.n_heads << "/" << sh.kv_heads << " window "
                                        << sh.window << " keys " << n_cached);
      const std::vector<float> q = RandomVec(rng, row, -1.0f, 1.0f);
      SetNumThreads(1);
      std::vector<float> want(row, NAN);
      ASSERT_TRUE(PagedAttention(p, {{table, n_cached, 1}}, q.data(), want.data()).ok());
      for (int threads : {1, 2, 3}) {
        SetNumThreads(threads);
        // The row's sequence with `before` query rows ahead of it in the call and
        // its own `n_query` rows (the row last), as the call's sequence `at`.
        auto expect_same = [&](const std::vector<AttentionSeq>& seqs, int at, const char* what) {
          int64_t rows = 0, mine = -1;
          for (size_t i = 0; i < seqs.size(); ++i) {
            rows += seqs[i].n_query;
            if (static_cast<int>(i) == at) mine = rows - 1;
          }
          std::vector<float> qs = RandomVec(rng, rows * row, -1.0f, 1.0f);
          std::copy(q.begin(), q.end(), qs.begin() + mine * row);
          std::vector<float> out(qs.size(), NAN);
          ASSERT_TRUE(PagedAttention(p, seqs, qs.data(), out.data()).ok());
          EXPECT_EQ(std::memcmp(out.data() + mine * row, want.data(), row * sizeof(float)), 0)
              << what << ", " << threads << " threads";
        };
        expect_same({{table, n_cached, 1}}, 0, "alone");
        expect_same({{table, kMaxKeys, 1}, {table, n_cached, 1}, {table, 40, 1}}, 1, "among decodes");
        expect_same({{table, n_cached, 7}}, 0, "last of a prefill chunk");
        expect_same({{table, 64, 64}, {table, n_cached, 1}}, 1, "beside a prefill");
        expect_same({{table, kMaxKeys, 30}, {table, n_cached, 12}}, 1, "in a batch of prefill chunks");
      }
    }
  }
}

TEST_P(CpuKernelsTest, PagedAttentionRejectsBadShapes) {
  PageLayout L{2, 3, 64, 16, KvDtype::kF16};
  std::vector<uint8_t> slab(static_cast<size_t>(L.page_bytes()));
  const std::vector<int32_t> pages = {0};
  std::vector<float> q(9 * 64), out(9 * 64);
  AttentionParams p;
  p.layout = L;
  p.kv_base = slab.data();
  p.n_heads = 8;  // not a multiple of kv_heads
  const AttentionSeq seq{pages, 5, 1};
  EXPECT_EQ(PagedAttention(p, {&seq, 1}, q.data(), out.data()).code(), absl::StatusCode::kInvalidArgument);
  p.n_heads = 9;
  const AttentionSeq long_seq{pages, 17, 1};  // 17 tokens need 2 pages
  EXPECT_EQ(PagedAttention(p, {&long_seq, 1}, q.data(), out.data()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(PagedAttention(p, {&seq, 1}, q.data(), out.data()).ok());
}

std::string LevelName(const ::testing::TestParamInfo<CpuKernelLevel>& info) {
  return CpuKernelLevelName(info.param);
}

INSTANTIATE_TEST_SUITE_P(Levels, CpuKernelsTest, ::testing::ValuesIn(SupportedCpuKernelLevels()), LevelName);

TEST(CpuFeaturesTest, LevelsAndThreads) {
  EXPECT_EQ(SupportedCpuKernelLevels().front(), CpuKernelLevel::kScalar);
  EXPECT_EQ(GetCpuKernelLevel(), MaxSupportedCpuKernelLevel());
  EXPECT_FALSE(SetCpuKernelLevel(static_cast<CpuKernelLevel>(7)).ok());
  SetNumThreads(0);
  EXPECT_EQ(NumThreads(), 1);
  SetNumThreads(2);
  EXPECT_EQ(NumThreads(), 2);
}

// Writes cache/index<i>/{level,size} under a fresh cpu directory.
std::string FakeCpuDir(const std::string& name,
                       const std::vector<std::pair<std::string, std::string>>& level_size) {
  const std::filesystem::path dir = std::filesystem::path(::testing::TempDir()) / name;
  std::filesystem::remove_all(dir);
  for (size_t i = 0; i < level_size.size(); ++i) {
    const std::filesystem::path index = dir / "cache" / ("index" + std::to_string(i));
    std::filesystem::create_directories(index);
    std::ofstream(index / "level") << level_size[i].first << "\n";
    std::ofstream(index / "size") << level_size[i].second << "\n";
  }
  return dir.string();
}

TEST(CpuFeaturesTest, L3FromSysfs) {
  EXPECT_EQ(
      L3CacheBytesFromSysfs(FakeCpuDir("zen3", {{"1", "32K"}, {"1", "32K"}, {"2", "512K"}, {"3", "32768K"}})),
      int64_t{32} << 20);
  EXPECT_EQ(L3CacheBytesFromSysfs(FakeCpuDir("mib", {{"2", "2M"}, {"3", "96M"}})), int64_t{96} << 20);
  EXPECT_EQ(L3CacheBytesFromSysfs(FakeCpuDir("no_l3", {{"1", "48K"}, {"2", "2048K"}})), 0);
  EXPECT_EQ(L3CacheBytesFromSysfs(FakeCpuDir("bad_size", {{"3", "big"}})), 0);
  EXPECT_EQ(L3CacheBytesFromSysfs(FakeCpuDir("bad_unit", {{"3", "32X"}})), 0);
  EXPECT_EQ(L3CacheBytesFromSysfs(::testing::TempDir() + "/no_such_cpu"), 0);
  // This machine: where Linux reports an L3, that is the figure (not CPUID's via glibc).
  const int64_t sysfs = L3CacheBytesFromSysfs("/sys/devices/system/cpu/cpu0");
  if (sysfs > 0) {
    EXPECT_EQ(L3CacheBytes(), sysfs);
  }
}

}  // namespace
}  // namespace kvcache::cpu
