#include "common/gguf/ggml_types.h"

#include <cmath>
#include <random>
#include <set>
#include <vector>

#include "common/gguf/dequant_chunk.h"
#include "common/gguf/fp16.h"
#include "gtest/gtest.h"
#include "tests/common/gguf/reference_data.h"

namespace kvcache {
namespace gguf {
namespace {

using ::kvcache::testing::Floats;
using ::kvcache::testing::Hex;
using ::kvcache::testing::LoadReference;

absl::StatusOr<GgmlType> TypeFromName(const std::string& name) {
  static const std::pair<const char*, GgmlType> kTypes[] = {
      {"F32", GgmlType::kF32},   {"F16", GgmlType::kF16},   {"BF16", GgmlType::kBF16},
      {"Q4_0", GgmlType::kQ4_0}, {"Q4_1", GgmlType::kQ4_1}, {"Q5_0", GgmlType::kQ5_0},
      {"Q5_1", GgmlType::kQ5_1}, {"Q8_0", GgmlType::kQ8_0}, {"Q4_K", GgmlType::kQ4_K},
      {"Q5_K", GgmlType::kQ5_K}, {"Q6_K", GgmlType::kQ6_K}};
  for (const auto& [n, t] : kTypes) {
    if (name == n) return t;
  }
  return absl::NotFoundError(name);
}

// |a - b| <= 1e-6 * max(|a|, |b|), or both exactly equal (incl. zeros).
bool CloseRel(float a, float b) {
  if (a == b) return true;
  return std::fabs(a - b) <= 1e-6f * std::max(std::fabs(a), std::fabs(b));
}

TEST(Fp16Test, RoundTripsEveryHalf) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = Fp16ToFp32(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(Fp16ToFp32(Fp32ToFp16(f))));
      continue;
    }
    ASSERT_EQ(Fp32ToFp16(f), h) << "half 0x" << std::hex << h;
  }
}

TEST(Fp16Test, KnownValuesAndRounding) {
  EXPECT_EQ(Fp16ToFp32(0x3C00), 1.0f);
  EXPECT_EQ(Fp16ToFp32(0xC000), -2.0f);
  EXPECT_EQ(Fp16ToFp32(0x0001), std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_EQ(Fp16ToFp32(0x7BFF), 65504.0f);
  EXPECT_TRUE(std::isinf(Fp16ToFp32(0x7C00)));
  EXPECT_EQ(Fp32ToFp16(65520.0f), 0x7C00);                      // rounds to inf
  EXPECT_EQ(Fp32ToFp16(1.0f + std::ldexp(1.0f, -11)), 0x3C00);  // tie -> even
  EXPECT_EQ(Fp32ToFp16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3C02);
  EXPECT_EQ(Fp32ToFp16(std::ldexp(1.0f, -25)), 0x0000);  // tie to even zero
  EXPECT_EQ(Fp32ToFp16(std::ldexp(1.5f, -25)), 0x0001);
}

TEST(Bf16Test, RoundTripAndRounding) {
  for (uint32_t b = 0; b < 65536; b += 7) {
    const float f = Bf16ToFp32(static_cast<uint16_t>(b));
    if (std::isnan(f)) continue;
    ASSERT_EQ(Fp32ToBf16(f), b);
  }
  EXPECT_EQ(Fp32ToBf16(1.0f), 0x3F80);
  EXPECT_EQ(Bf16ToFp32(Fp32ToBf16(1.00390625f)), 1.0f);  // tie -> even
}

TEST(RowBytesTest, SizesAndErrors) {
  EXPECT_EQ(*RowBytes(GgmlType::kQ4_1, 576), 18 * 20);
  EXPECT_EQ(*RowBytes(GgmlType::kQ6_K, 512), 2 * 210);
  EXPECT_EQ(*RowBytes(GgmlType::kF16, 3), 6);
  EXPECT_EQ(RowBytes(GgmlType::kQ4_0, 33).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RowBytes(static_cast<GgmlType>(99), 32).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(RowBytes(GgmlType::kF32, int64_t{1} << 62).ok());  // overflow
}

TEST(DequantizeTest, UnsupportedTypeIsClearError) {
  std::vector<uint8_t> raw(84, 0);
  std::vector<float> out(256);
  absl::Status s = DequantizeRow(GgmlType::kQ2_K, raw.data(), out.data(), 256);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented);
  EXPECT_NE(s.message().find("q2_K"), std::string::npos) << s;
  EXPECT_EQ(VecDot(GgmlType::kQ2_K, raw.data(), out.data(), 256).status().code(),
            absl::StatusCode::kUnimplemented);
  EXPECT_EQ(DequantizeRow(GgmlType::kQ4_0, raw.data(), out.data(), 31).code(),
            absl::StatusCode::kInvalidArgument);
}

// The gguf Python package's dequantize of synthetic blocks (quantised values
// and raw random bit patterns) recorded by tests/data/record_model_reference.py.
TEST(DequantizeTest, MatchesGgufPackageOnSyntheticBlocks) {
  auto ref = LoadReference("dequant_reference.json");
  ASSERT_TRUE(ref.ok()) << ref.status();
  const auto& cases = ref->fields().at("synthetic").list_value().values();
  ASSERT_GE(cases.size(), 15);
  std::set<std::string> types_seen;
  for (const auto& c : cases) {
    const auto& f = c.struct_value().fields();
    const std::string name = f.at("type").string_value() + "/" + f.at("kind").string_value();
    auto type = TypeFromName(f.at("type").string_value());
    ASSERT_TRUE(type.ok()) << name;
    types_seen.insert(f.at("type").string_value());
    const std::string raw = Hex(f.at("raw_hex"));
    const std::vector<float> want = Floats(f.at("values"));
    const int64_t n = static_cast<int64_t>(f.at("n").number_value());
    ASSERT_EQ(static_cast<int64_t>(want.size()), n);
    ASSERT_EQ(static_cast<int64_t>(raw.size()), *RowBytes(*type, n)) << name;
    std::vector<float> got(n);
    ASSERT_TRUE(DequantizeRow(*type, raw.data(), got.data(), n).ok()) << name;
    int exact = 0;
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_TRUE(CloseRel(got[i], want[i]))
          << name << " element " << i << ": " << got[i] << " vs " << want[i];
      exact += got[i] == want[i] || (got[i] == 0 && want[i] == 0);
    }
    // Every supported type decodes with the same float32 operations as ggml,
    // so the match is bit-exact, not merely close.
    EXPECT_EQ(exact, n) << name;
  }
  EXPECT_EQ(types_seen.size(), 10u);
}

// The chunk decoder the CUDA kernels run: the types it takes are exactly the
// supported ones, and every chunk of a row equals DequantizeRow's values bit for
// bit (the host's block decoders, which match the gguf package above).
TEST(DequantChunkTest, EveryChunkOfEverySupportedTypeEqualsDequantizeRow) {
  int decodable = 0;
  for (uint32_t raw = 0; raw < 40; ++raw) {
    const GgmlTypeTraits* t = GetTypeTraits(raw);
    if (t == nullptr) continue;
    const GgmlType type = static_cast<GgmlType>(raw);
    EXPECT_EQ(ChunkDecodable(type), t->supported) << t->name;
    if (!t->supported) continue;
    ++decodable;
    const int64_t n = 512;
    std::mt19937 rng(raw);
    std::normal_distribution<float> dist(0.0f, 1.0f);
    std::vector<float> x(n);
    for (float& v : x) v = dist(rng);
    std::vector<uint8_t> q(*RowBytes(type, n));
    ASSERT_TRUE(QuantizeRow(type, x.data(), q.data(), n).ok());
    std::vector<float> want(n);
    ASSERT_TRUE(DequantizeRow(type, q.data(), want.data(), n).ok());
    std::vector<float> got(n, -1.0f);
    EXPECT_TRUE(VisitChunkType(type, [&](auto tag) {
      for (int64_t c = 0; c < n / kChunk; ++c)
        DequantChunk8<decltype(tag)::value>(q.data(), c, &got[c * kChunk]);
    }));
    EXPECT_EQ(got, want) << t->name;
  }
  EXPECT_EQ(decodable, 11);
}

class QuantizeRoundTripTest : public ::testing::TestWithParam<GgmlType> {};

TEST_P(QuantizeRoundTripTest, ErrorIsBoundedAndVecDotAgrees) {
  const GgmlType type = GetParam();
  const int64_t n = 512;
  std::mt19937 rng(7);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> x(n), y(n);
  for (auto& v : x) v = dist(rng);
  for (auto& v : y) v = dist(rng);
  std::vector<uint8_t> q(*RowBytes(type, n));
  ASSERT_TRUE(QuantizeRow(type, x.data(), q.data(), n).ok());
  std::vector<float> back(n);
  ASSERT_TRUE(DequantizeRow(type, q.data(), back.data(), n).ok());
  double err2 = 0, norm2 = 0;
  for (int64_t i = 0; i < n; ++i) {
    err2 += (back[i] - x[i]) * (back[i] - x[i]);
    norm2 += x[i] * x[i];
  }
  const double rel = std::sqrt(err2 / norm2);
  // 4-bit types: ~10% relative RMS error; 8-bit and floats much lower.
  const double bound = type == GgmlType::kF32 ? 0 : type == GgmlType::kQ8_0 ? 0.01 : 0.2;
  EXPECT_LE(rel, bound) << TypeName(type);
  double want = 0;
  for (int64_t i = 0; i < n; ++i) want += static_cast<double>(back[i]) * y[i];
  auto dot = VecDot(type, q.data(), y.data(), n);
  ASSERT_TRUE(dot.ok());
  EXPECT_NEAR(*dot, want, 1e-4 * (1 + std::fabs(want))) << TypeName(type);
}

INSTANTIATE_TEST_SUITE_P(AllTypes, QuantizeRoundTripTest,
                         ::testing::Values(GgmlType::kF32, GgmlType::kF16, GgmlType::kBF16, GgmlType::kQ4_0,
                                           GgmlType::kQ4_1, GgmlType::kQ5_0, GgmlType::kQ5_1, GgmlType::kQ8_0,
                                           GgmlType::kQ4_K, GgmlType::kQ5_K, GgmlType::kQ6_K),
                         [](const ::testing::TestParamInfo<GgmlType>& info) {
                           return std::string(TypeName(info.param));
                         });

}  // namespace
}  // namespace gguf
}  // namespace kvcache
