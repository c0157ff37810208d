#include "common/gguf/gguf_reader.h"

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "common/gguf/gguf_writer.h"
#include "gtest/gtest.h"

namespace kvcache {
namespace gguf {
namespace {

std::string SmallFile() {
  GgufWriter w;
  w.AddString("general.architecture", "llama");
  w.AddUint8("u8", 200);
  w.AddInt32("i32", -5);
  w.AddUint32("u32", 7);
  w.AddUint64("u64", uint64_t{1} << 40);
  w.AddFloat32("f32", 0.5f);
  w.AddFloat64("f64", -2.25);
  w.AddBool("flag", true);
  w.AddStringArray("strs", {"a", "", "ccc"});
  w.AddInt32Array("ints", {1, -2, 3});
  w.AddFloat32Array("floats", {1.5f, -0.25f});
  std::vector<float> vals(64 * 2);
  for (size_t i = 0; i < vals.size(); ++i) vals[i] = static_cast<float>(i) * 0.125f;
  EXPECT_TRUE(w.AddTensorFromFloats("t.f32", GgmlType::kF32, {64, 2}, vals).ok());
  EXPECT_TRUE(w.AddTensorFromFloats("t.q8", GgmlType::kQ8_0, {64, 2}, vals).ok());
  EXPECT_TRUE(w.AddTensorFromFloats("t.f16", GgmlType::kF16, {3}, {1, 2, 3}).ok());
  return *w.Serialize();
}

// Builds header + raw bytes by hand for hostile cases.
struct Raw {
  std::string b;
  template <typename T>
  Raw& Put(T v) {
    char buf[sizeof(T)];
    memcpy(buf, &v, sizeof(T));
    b.append(buf, sizeof(T));
    return *this;
  }
  Raw& Str(const std::string& s) {
    Put<uint64_t>(s.size());
    b += s;
    return *this;
  }
  Raw& Header(uint64_t n_tensors, uint64_t n_kv, uint32_t version = 3) {
    b += "GGUF";
    return Put<uint32_t>(version).Put<uint64_t>(n_tensors).Put<uint64_t>(n_kv);
  }
};

void ExpectInvalid(const std::string& bytes, const std::string& needle) {
  auto f = GgufFile::OpenFromBuffer(bytes);
  ASSERT_FALSE(f.ok()) << "expected an error mentioning '" << needle << "'";
  EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument) << f.status();
  EXPECT_TRUE(absl::StrContains(f.status().message(), needle)) << f.status();
}

TEST(GgufReaderTest, ReadsEveryValueTypeAndTensor) {
  auto f = GgufFile::OpenFromBuffer(SmallFile());
  ASSERT_TRUE(f.ok()) << f.status();
  const GgufFile& g = **f;
  EXPECT_EQ(g.version(), 3u);
  EXPECT_EQ(*g.GetString("general.architecture"), "llama");
  EXPECT_EQ(*g.GetUint32("u8"), 200u);
  EXPECT_EQ(*g.FindValue("i32")->AsInt64(), -5);
  EXPECT_FALSE(g.GetUint64("i32").ok());  // negative
  EXPECT_EQ(*g.GetUint64("u64"), uint64_t{1} << 40);
  EXPECT_FALSE(g.GetUint32("u64").ok());  // does not fit
  EXPECT_EQ(*g.GetDouble("f32"), 0.5);
  EXPECT_EQ(*g.GetDouble("f64"), -2.25);
  EXPECT_TRUE(*g.GetBool("flag"));
  EXPECT_EQ(g.GetString("missing").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(g.GetString("u32").status().code(), absl::StatusCode::kInvalidArgument);
  auto strs = g.FindValue("strs")->AsStringArray();
  ASSERT_TRUE(strs.ok());
  EXPECT_EQ(strs->size(), 3u);
  EXPECT_EQ((*strs)[2], "ccc");
  EXPECT_EQ(*g.FindValue("ints")->AsIntArray(), (std::vector<int64_t>{1, -2, 3}));
  EXPECT_EQ(*g.FindValue("floats")->AsDoubleArray(), (std::vector<double>{1.5, -0.25}));
  EXPECT_FALSE(g.FindValue("strs")->AsIntArray().ok());

  ASSERT_EQ(g.tensors().size(), 3u);
  auto t = g.GetTensor("t.q8");
  ASSERT_TRUE(t.ok());
  EXPECT_EQ((*t)->type, GgmlType::kQ8_0);
  EXPECT_EQ((*t)->ne[0], 64);
  EXPECT_EQ((*t)->ne[1], 2);
  EXPECT_EQ((*t)->row_bytes, 68);
  EXPECT_EQ((*t)->ShapeString(), "[64, 2]");
  EXPECT_EQ(reinterpret_cast<uintptr_t>((*t)->data) % 32,
            reinterpret_cast<uintptr_t>(g.tensors()[0].data) % 32);
  std::vector<float> row(64);
  ASSERT_TRUE(GgufFile::DequantizeTensorRow(**g.GetTensor("t.f32"), 1, row.data()).ok());
  EXPECT_EQ(row[0], 64 * 0.125f);
  ASSERT_TRUE(GgufFile::DequantizeTensorRow(**t, 1, row.data()).ok());
  EXPECT_NEAR(row[5], 69 * 0.125f, 0.1);
  EXPECT_EQ(GgufFile::DequantizeTensorRow(**t, 2, row.data()).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(g.GetTensor("nope").status().code(), absl::StatusCode::kNotFound);
}

TEST(GgufReaderTest, CustomAlignment) {
  GgufWriter w(64);
  ASSERT_TRUE(w.AddTensorFromFloats("a", GgmlType::kF32, {3}, {1, 2, 3}).ok());
  ASSERT_TRUE(w.AddTensorFromFloats("b", GgmlType::kF32, {2}, {4, 5}).ok());
  auto f = GgufFile::OpenFromBuffer(*w.Serialize());
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ((*f)->alignment(), 64u);
  EXPECT_EQ((*f)->data_offset() % 64, 0u);
  EXPECT_EQ((*f)->FindTensor("b")->offset, 64u);
  float v;
  memcpy(&v, (*f)->FindTensor("b")->data, 4);
  EXPECT_EQ(v, 4.0f);
}

TEST(GgufReaderTest, OpenFromDiskAndMissingFile) {
  const std::string path = ::testing::TempDir() + "/small.gguf";
  GgufWriter w;
  w.AddString("k", "v");
  ASSERT_TRUE(w.WriteToFile(path).ok());
  auto f = GgufFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(*(*f)->GetString("k"), "v");
  auto missing = GgufFile::Open(path + ".nope");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
}

TEST(GgufReaderTest, EveryTruncationIsAnErrorNotACrash) {
  const std::string full = SmallFile();
  ASSERT_TRUE(GgufFile::OpenFromBuffer(full).ok());
  for (size_t n = 0; n < full.size(); ++n) {
    auto f = GgufFile::OpenFromBuffer(full.substr(0, n));
    // The last tensor's padding is not data, so a file cut inside the final
    // alignment padding may still be valid; anything shorter must fail.
    if (f.ok()) {
      EXPECT_GE(n, full.size() - 32) << "accepted a file truncated to " << n << " bytes";
    } else {
      EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument);
    }
  }
}

TEST(GgufReaderTest, RandomCorruptionNeverCrashes) {
  const std::string full = SmallFile();
  std::mt19937 rng(42);
  int rejected = 0;
  for (int iter = 0; iter < 3000; ++iter) {
    std::string b = full;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int k = 0; k < flips; ++k) b[rng() % b.size()] = static_cast<char>(rng());
    auto f = GgufFile::OpenFromBuffer(b);
    if (!f.ok()) {
      ++rejected;
      continue;
    }
    // Whatever was accepted must be internally consistent.
    for (const auto& t : (*f)->tensors()) {
      ASSERT_NE(t.data, nullptr);
      ASSERT_LE(t.offset + t.size_bytes, (*f)->file_size() - (*f)->data_offset());
    }
  }
  EXPECT_GT(rejected, 100);
}

TEST(GgufReaderTest, HostileHeaders) {
  ExpectInvalid("", "bad magic");
  ExpectInvalid("GGML\x03\0\0\0", "bad magic");
  ExpectInvalid(Raw().Header(0, 0, 1).b, "unsupported GGUF version 1");
  ExpectInvalid(Raw().Header(0, 0, 99).b, "unsupported GGUF version 99");
  ExpectInvalid(Raw().Header(0, uint64_t{1} << 62).b, "metadata count");
  ExpectInvalid(Raw().Header(uint64_t{1} << 40, 0).b, "tensor count");
  ExpectInvalid(Raw().Header(0, 1).Str("k").Put<uint32_t>(77).b, "unknown value type 77");
  ExpectInvalid(Raw().Header(0, 1).Put<uint64_t>(uint64_t{1} << 60).b + std::string(16, 0), "length");
  ExpectInvalid(Raw().Header(0, 1).Str("k").Put<uint32_t>(8).Put<uint64_t>(1000).b, "truncated");
  ExpectInvalid(
      Raw().Header(0, 1).Str("k").Put<uint32_t>(9).Put<uint32_t>(4).Put<uint64_t>(uint64_t{1} << 61).b,
      "does not fit");
  ExpectInvalid(Raw().Header(0, 1).Str("k").Put<uint32_t>(9).Put<uint32_t>(9).Put<uint64_t>(1).b,
                "nested array");
  ExpectInvalid(
      Raw().Header(0, 1).Str("k").Put<uint32_t>(9).Put<uint32_t>(8).Put<uint64_t>(uint64_t{1} << 40).b,
      "does not fit");
  ExpectInvalid(Raw().Header(0, 1).Str("b").Put<uint32_t>(7).Put<uint8_t>(2).b, "bool");
  ExpectInvalid(Raw()
                    .Header(0, 2)
                    .Str("k")
                    .Put<uint32_t>(4)
                    .Put<uint32_t>(1)
                    .Str("k")
                    .Put<uint32_t>(4)
                    .Put<uint32_t>(1)
                    .b,
                "duplicate metadata key");
  ExpectInvalid(Raw().Header(0, 1).Str("general.alignment").Put<uint32_t>(4).Put<uint32_t>(48).b,
                "power of two");
  ExpectInvalid(Raw().Header(0, 1).Str("general.alignment").Put<uint32_t>(4).Put<uint32_t>(0).b,
                "power of two");
}

// One tensor info with the given fields, then `data_bytes` of zeros after
// 32-byte alignment.
std::string OneTensor(const std::string& name, std::vector<uint64_t> dims, uint32_t type, uint64_t offset,
                      size_t data_bytes, uint32_t n_dims_override = 0) {
  Raw r;
  r.Header(1, 0).Str(name).Put<uint32_t>(n_dims_override ? n_dims_override
                                                         : static_cast<uint32_t>(dims.size()));
  for (uint64_t d : dims) r.Put<uint64_t>(d);
  r.Put<uint32_t>(type).Put<uint64_t>(offset);
  r.b.resize((r.b.size() + 31) / 32 * 32, '\0');
  r.b.append(data_bytes, '\0');
  return r.b;
}

TEST(GgufReaderTest, HostileTensorInfos) {
  ASSERT_TRUE(GgufFile::OpenFromBuffer(OneTensor("t", {4}, 0, 0, 16)).ok());
  ExpectInvalid(OneTensor("t", {4}, 0, 0, 15), "past the end");
  ExpectInvalid(OneTensor("t", {4}, 0, 32, 16), "past the end");
  ExpectInvalid(OneTensor("t", {4}, 0, uint64_t{1} << 63, 16), "past the end");
  ExpectInvalid(OneTensor("t", {4}, 0, 4, 64), "not a multiple of the alignment");
  ExpectInvalid(OneTensor("t", {4}, 123, 0, 16), "unknown ggml type 123");
  ExpectInvalid(OneTensor("t", {33}, 2, 0, 64), "blocks");  // Q4_0 needs 32-multiples
  ExpectInvalid(OneTensor("t", {}, 0, 0, 16), "dimensions");
  ExpectInvalid(OneTensor("t", {1, 1, 1, 1, 1}, 0, 0, 16), "dimensions");
  ExpectInvalid(OneTensor("t", {0}, 0, 0, 16), "zero or overflows");
  ExpectInvalid(OneTensor("t", {uint64_t{1} << 40, uint64_t{1} << 40}, 0, 0, 16), "zero or overflows");
  ExpectInvalid(OneTensor("t", {uint64_t{1} << 61}, 0, 0, 16), "overflows");
  ExpectInvalid(OneTensor(std::string(100, 'x'), {4}, 0, 0, 16), "name length");
  ExpectInvalid(OneTensor("", {4}, 0, 0, 16), "name length");
  // Duplicate tensor names.
  Raw r;
  r.Header(2, 0);
  for (int i = 0; i < 2; ++i) r.Str("t").Put<uint32_t>(1).Put<uint64_t>(4).Put<uint32_t>(0).Put<uint64_t>(0);
  r.b.resize(96, '\0');
  ExpectInvalid(r.b, "duplicate tensor name");
}

TEST(GgufWriterTest, RejectsBadInput) {
  GgufWriter w;
  EXPECT_FALSE(w.AddTensor("t", GgmlType::kF32, {4}, std::string(15, '\0')).ok());
  EXPECT_FALSE(w.AddTensor("t", GgmlType::kQ4_0, {16}, std::string(9, '\0')).ok());
  EXPECT_FALSE(w.AddTensorFromFloats("t", GgmlType::kF32, {4}, {1, 2, 3}).ok());
  w.AddUint32("k", 1);
  w.AddUint32("k", 2);
  EXPECT_EQ(w.Serialize().status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace gguf
}  // namespace kvcache
