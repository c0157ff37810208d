#include "common/gguf/tiny_llama.h"

#include "common/gguf/gguf_reader.h"
#include "common/gguf/llama_hparams.h"
#include "common/tokenizer/chat_template.h"
#include "common/tokenizer/tokenizer.h"
#include "gtest/gtest.h"

namespace kvcache {
namespace gguf {
namespace {

class TinyLlamaTest : public ::testing::TestWithParam<GgmlType> {};

TEST_P(TinyLlamaTest, BuildsALoadableModel) {
  TinyLlamaOptions o;
  o.weight_type = GetParam();
  const int64_t block = TypeTraits(o.weight_type).block_size;
  if (block == 256) {
    o.n_embd = 256;
    o.n_ff = 512;
  }
  o.tied_embeddings = false;
  o.sliding_window = 32;
  auto bytes = BuildTinyLlama(o);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  auto f = GgufFile::OpenFromBuffer(*bytes);
  ASSERT_TRUE(f.ok()) << f.status();
  auto h = LoadLlamaHparams(**f);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->n_layer, 2);
  EXPECT_EQ(h->n_head, 4);
  EXPECT_EQ(h->n_head_kv, 2);
  EXPECT_EQ(h->head_dim, o.n_embd / 4);
  EXPECT_EQ(h->sliding_window, 32);
  EXPECT_FALSE(h->tied_embeddings);
  EXPECT_EQ((*f)->FindTensor("blk.1.ffn_down.weight")->type, o.weight_type);
  EXPECT_EQ((*f)->FindTensor("blk.1.ffn_norm.weight")->type, GgmlType::kF32);
  EXPECT_EQ((*f)->tensors().size(), 1u + 2 * 9 + 2);
  // Weights decode to the requested uniform range (up to quantisation error).
  const GgufTensorInfo* q = (*f)->FindTensor("blk.0.attn_q.weight");
  std::vector<float> row(q->ne[0]);
  ASSERT_TRUE(GgufFile::DequantizeTensorRow(*q, 3, row.data()).ok());
  float amax = 0;
  for (float v : row) amax = std::max(amax, std::fabs(v));
  EXPECT_GT(amax, 0.02f);
  EXPECT_LT(amax, 0.06f);

  auto tok = tok::Tokenizer::FromGguf(**f);
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ((*tok)->n_vocab(), h->n_vocab);
  auto chat = tok::ChatTemplate::FromGguf(**f);
  ASSERT_TRUE(chat.ok()) << chat.status();
}

INSTANTIATE_TEST_SUITE_P(Types, TinyLlamaTest,
                         ::testing::Values(GgmlType::kF32, GgmlType::kF16, GgmlType::kBF16, GgmlType::kQ8_0,
                                           GgmlType::kQ4_0, GgmlType::kQ4_1, GgmlType::kQ5_0, GgmlType::kQ5_1,
                                           GgmlType::kQ4_K, GgmlType::kQ6_K),
                         [](const ::testing::TestParamInfo<GgmlType>& info) {
                           return std::string(TypeName(info.param));
                         });

TEST(TinyLlamaOptionsTest, RejectsInconsistentShapes) {
  TinyLlamaOptions o;
  o.n_head = 5;  // 64 % 5 != 0
  EXPECT_EQ(BuildTinyLlama(o).status().code(), absl::StatusCode::kInvalidArgument);
  o = TinyLlamaOptions();
  o.weight_type = GgmlType::kQ4_K;  // n_embd 64 is not a multiple of 256
  EXPECT_EQ(BuildTinyLlama(o).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(TinyLlamaOptionsTest, TypeOverridesPickMatricesBySuffix) {
  TinyLlamaOptions o;
  o.n_embd = 256;
  o.n_ff = 512;
  o.weight_type = GgmlType::kQ4_K;
  o.type_overrides = {{"attn_v.weight", GgmlType::kQ6_K}, {"ffn_down.weight", GgmlType::kQ8_0}};
  auto f = GgufFile::OpenFromBuffer(std::move(BuildTinyLlama(o)).value());
  ASSERT_TRUE(f.ok()) << f.status();
  int q6 = 0, q8 = 0, q4 = 0;
  for (const auto& t : (*f)->tensors()) {
    const bool v = t.name.find("attn_v.weight") != std::string::npos;
    const bool down = t.name.find("ffn_down.weight") != std::string::npos;
    EXPECT_EQ(t.type == GgmlType::kQ6_K, v) << t.name;
    EXPECT_EQ(t.type == GgmlType::kQ8_0, down) << t.name;
    q6 += t.type == GgmlType::kQ6_K;
    q8 += t.type == GgmlType::kQ8_0;
    q4 += t.type == GgmlType::kQ4_K;
  }
  EXPECT_EQ(q6, o.n_layer);
  EXPECT_EQ(q8, o.n_layer);
  EXPECT_EQ(q4, 1 + 5 * o.n_layer);  // token_embd; q, k, attn_output, gate, up
  o.type_overrides = {{"ffn_down.weight", GgmlType::kQ6_K}};
  o.n_ff = 320;  // not a multiple of 256
  o.weight_type = GgmlType::kQ8_0;
  EXPECT_EQ(BuildTinyLlama(o).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(TinyLlamaOptionsTest, WritesToDiskAndIsDeterministic) {
  TinyLlamaOptions o;
  const std::string path = ::testing::TempDir() + "/tiny.gguf";
  ASSERT_TRUE(WriteTinyLlama(o, path).ok());
  auto f = GgufFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_TRUE(LoadLlamaHparams(**f)->tied_embeddings);
  EXPECT_EQ(*BuildTinyLlama(o), *BuildTinyLlama(o));
  TinyLlamaOptions o2 = o;
  o2.seed = 2;
  EXPECT_NE(*BuildTinyLlama(o), *BuildTinyLlama(o2));
}

}  // namespace
}  // namespace gguf
}  // namespace kvcache
