// Checks against the real default model (SmolLM2-135M-Instruct Q4_1), which
// scripts/setup.sh fetches. A missing model is a test failure naming that
// command, never a skip.
#include <cmath>
#include <memory>
#include <set>

#include "absl/strings/match.h"
#include "common/gguf/gguf_reader.h"
#include "common/gguf/llama_hparams.h"
#include "common/gguf/model_path.h"
#include "gtest/gtest.h"
#include "tests/common/gguf/reference_data.h"

namespace kvcache {
namespace gguf {
namespace {

using ::kvcache::testing::Floats;
using ::kvcache::testing::LoadReference;

class ModelTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto f = OpenModelFile(DefaultModelPath());
    if (f.ok()) {
      file_ = f->release();
    } else {
      error_ = new std::string(f.status().ToString());
    }
  }
  static void TearDownTestSuite() {
    delete file_;
    file_ = nullptr;
  }
  void SetUp() override { ASSERT_NE(file_, nullptr) << *error_; }
  static GgufFile* file_;
  static std::string* error_;
};
GgufFile* ModelTest::file_ = nullptr;
std::string* ModelTest::error_ = nullptr;

TEST(ModelPathTest, MissingModelNamesTheSetUpCommand) {
  auto f = OpenModelFile("/nonexistent/dir/model.gguf");
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(absl::StrContains(f.status().message(), "scripts/setup.sh")) << f.status();
  EXPECT_TRUE(absl::StrContains(f.status().message(), "/nonexistent/dir/model.gguf"));
}

TEST(ModelPathTest, DefaultPathHonoursEnvironment) {
  const char* old = getenv("KVCACHE_MODEL");
  const std::string saved = old ? old : "";
  setenv("KVCACHE_MODEL", "/x/y.gguf", 1);
  EXPECT_EQ(DefaultModelPath(), "/x/y.gguf");
  unsetenv("KVCACHE_MODEL");
  EXPECT_TRUE(absl::EndsWith(DefaultModelPath(), "/.cache/kvcache/models/SmolLM2-135M-Instruct.Q4_1.gguf"));
  if (old != nullptr) setenv("KVCACHE_MODEL", saved.c_str(), 1);
}

TEST_F(ModelTest, HyperParameters) {
  auto h = LoadLlamaHparams(*file_);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->architecture, "llama");
  EXPECT_EQ(h->n_layer, 30);
  EXPECT_EQ(h->n_embd, 576);
  EXPECT_EQ(h->n_ff, 1536);
  EXPECT_EQ(h->n_head, 9);
  EXPECT_EQ(h->n_head_kv, 3);
  EXPECT_EQ(h->head_dim, 64);
  EXPECT_EQ(h->n_rot, 64);
  EXPECT_EQ(h->n_ctx_train, 8192);
  EXPECT_EQ(h->n_vocab, 49152);
  EXPECT_EQ(h->rope_freq_base, 100000.0);
  EXPECT_NEAR(h->norm_rms_eps, 1e-5, 1e-12);
  EXPECT_EQ(h->sliding_window, 0);
  EXPECT_TRUE(h->tied_embeddings);
  EXPECT_EQ(h->KvBytesPerToken(2), 2 * 30 * 3 * 64 * 2);
}

TEST_F(ModelTest, TensorInventory) {
  EXPECT_EQ(file_->tensors().size(), 272u);
  int q41 = 0, f32 = 0, q80 = 0;
  for (const auto& t : file_->tensors()) {
    q41 += t.type == GgmlType::kQ4_1;
    f32 += t.type == GgmlType::kF32;
    q80 += t.type == GgmlType::kQ8_0;
    EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data) % 32, 0u) << t.name;
  }
  EXPECT_EQ(q41, 210);
  EXPECT_EQ(f32, 61);
  EXPECT_EQ(q80, 1);
  const GgufTensorInfo* q = file_->FindTensor("blk.0.attn_q.weight");
  ASSERT_NE(q, nullptr);
  EXPECT_EQ(q->ShapeString(), "[576, 576]");
  EXPECT_EQ(file_->FindTensor("blk.29.ffn_down.weight")->ShapeString(), "[1536, 576]");
  EXPECT_EQ(file_->FindTensor("output.weight"), nullptr);
}

// Rows of every tensor type in the file against gguf.quants.dequantize.
TEST_F(ModelTest, DequantizedRowsMatchGgufPackage) {
  auto ref = LoadReference("dequant_reference.json");
  ASSERT_TRUE(ref.ok()) << ref.status();
  const auto& rows = ref->fields().at("model_rows").list_value().values();
  ASSERT_GE(rows.size(), 8);
  std::set<GgmlType> types;
  for (const auto& r : rows) {
    const auto& f = r.struct_value().fields();
    const std::string name = f.at("tensor").string_value();
    const int64_t row = static_cast<int64_t>(f.at("row").number_value());
    const GgufTensorInfo* t = file_->FindTensor(name);
    ASSERT_NE(t, nullptr) << name;
    types.insert(t->type);
    const std::vector<float> want = Floats(f.at("values"));
    ASSERT_EQ(static_cast<int64_t>(want.size()), t->ne[0]);
    std::vector<float> got(t->ne[0]);
    ASSERT_TRUE(GgufFile::DequantizeTensorRow(*t, row, got.data()).ok());
    for (int64_t i = 0; i < t->ne[0]; ++i) {
      ASSERT_EQ(got[i], want[i]) << name << " row " << row << " element " << i;
    }
  }
  EXPECT_EQ(types.size(), 3u);  // F32, Q4_1, Q8_0
}

}  // namespace
}  // namespace gguf
}  // namespace kvcache
