// Every supported architecture against llama.cpp, on tiny random-weight models
// (gguf::ArchitectureReferenceModels: Llama 3.1 with rope_freqs and an untied
// output, Qwen 2.5 with Q/K/V biases and NeoX RoPE, Qwen 3 with per-head Q/K
// RMSNorm and a head size from key_length, Qwen 2.5 with Q8_0 weights).
// tests/data/arch_reference.json holds llama.cpp's logits at every position of
// a 12-token sequence on the same files (tests/data/record_arch_reference.py,
// llama.cpp built from the llama-cpp-python sdist's source). Our CPU forward
// pass with an f16 paged KV cache, as the worker serves, must agree at every
// position, whether the tokens arrive one per step, all at once, or in two
// chunks, at every kernel level this machine has. Logits span about +-4.
// Measured here (the test prints the worst difference): f32 weights within
// 2.2e-3 (llama.cpp rounds Q to f16 for its f16-K products), Q8_0 within 0.08
// (both engines quantise activations to 8 bits, rounding differently).
// Sensitivity, checked by breaking the code once: RoPE on adjacent pairs for
// the Qwen files, or rope_freqs ignored, moves the logits by 0.7 to 3.4.
#include <openssl/sha.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "absl/strings/escaping.h"
#include "common/gguf/gguf_reader.h"
#include "common/gguf/llama_hparams.h"
#include "common/gguf/tiny_llama.h"
#include "common/status_macros.h"
#include "gtest/gtest.h"
#include "tests/common/gguf/reference_data.h"
#include "tests/common/tokenizer/llamacpp_vocab.h"
#include "worker/backend/cpu/cpu_features.h"
#include "worker/backend/cpu/cpu_llama_runner.h"
#include "worker/kv/kv_cache_manager.h"
#include "worker/model/llama_model.h"

namespace kvcache {
namespace {

constexpr float kF32Tolerance = 1e-2f;
constexpr float kQuantTolerance = 0.2f;

std::string Sha256Hex(const std::string& bytes) {
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size(), digest);
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(digest), SHA256_DIGEST_LENGTH));
}

struct Harness {
  std::unique_ptr<model::LlamaModel> model;
  std::unique_ptr<kv::KvCacheManager> kv;
  std::unique_ptr<cpu::CpuLlamaRunner> runner;

  // Runs `tokens` of session `id` as one step and returns the last token's logits.
  std::vector<float> Step(const std::string& id, const std::vector<int32_t>& tokens) {
    auto res = kv->BeginStep(id, static_cast<int64_t>(tokens.size()));
    EXPECT_TRUE(res.ok()) << res.status();
    if (!res.ok()) return {};
    model::SequenceStep s;
    s.tokens = tokens;
    s.first_pos = res->first_pos;
    s.page_table = res->page_table;
    s.want_logits = true;
    std::vector<float> logits;
    const absl::Status st = runner->Forward({s}, &logits);
    EXPECT_TRUE(st.ok()) << st;
    EXPECT_TRUE(kv->CommitStep(id, tokens).ok());
    return logits;
  }
};

absl::StatusOr<Harness> Load(const gguf::NamedTinyModel& m, std::string* sha256) {
  gguf::TinyLlamaOptions options = m.options;
  std::unique_ptr<gguf::GgufFile> vocab;
  if (!m.vocab.empty()) {
    auto f = gguf::GgufFile::Open(testing::LlamaCppVocabPath(m.vocab));
    if (!f.ok()) return absl::NotFoundError(absl::StrCat(f.status().message(), testing::kLlamaCppVocabHint));
    vocab = std::move(*f);
    options.vocab = vocab.get();
  }
  KVCACHE_ASSIGN_OR_RETURN(std::string bytes, gguf::BuildTinyLlama(options));
  *sha256 = Sha256Hex(bytes);
  KVCACHE_ASSIGN_OR_RETURN(auto file, gguf::GgufFile::OpenFromBuffer(std::move(bytes)));
  Harness h;
  KVCACHE_ASSIGN_OR_RETURN(h.model, model::LlamaModel::FromFile(std::move(file)));
  const auto& hp = h.model->hparams();
  kv::KvCacheOptions ko;
  ko.shape = kv::KvShape{static_cast<int>(hp.n_layer),
                         static_cast<int>(hp.n_head_kv),
                         static_cast<int>(hp.head_dim),
                         kv::KvDtype::kF16,
                         16,
                         0};
  ko.model_id = h.model->model_id();
  ko.tier0_bytes = 16 * ko.shape.page_bytes();
  KVCACHE_ASSIGN_OR_RETURN(h.kv, kv::KvCacheManager::Create(ko));
  KVCACHE_ASSIGN_OR_RETURN(h.runner, cpu::CpuLlamaRunner::Create(h.model.get(), h.kv.get(), {64, 1}));
  return h;
}

float MaxAbsDiff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  float worst = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) worst = std::max(worst, std::fabs(a[i] - b[i]));
  return worst;
}

class ArchReferenceTest : public ::testing::TestWithParam<cpu::CpuKernelLevel> {
 protected:
  void SetUp() override { ASSERT_TRUE(cpu::SetCpuKernelLevel(GetParam()).ok()); }
  void TearDown() override { ASSERT_TRUE(cpu::SetCpuKernelLevel(cpu::MaxSupportedCpuKernelLevel()).ok()); }
};

TEST_P(ArchReferenceTest, LogitsMatchLlamaCppAtEveryPosition) {
  auto ref = testing::LoadReference("arch_reference.json");
  ASSERT_TRUE(ref.ok()) << ref.status();
  const auto& recorded = ref->fields().at("models").list_value().values();
  const std::vector<gguf::NamedTinyModel> models = gguf::ArchitectureReferenceModels();
  ASSERT_EQ(recorded.size(), models.size()) << "re-run tests/data/record_arch_reference.py";
  for (const auto& r : recorded) {
    const auto& f = r.struct_value().fields();
    const std::string name = f.at("name").string_value();
    SCOPED_TRACE(name);
    const gguf::NamedTinyModel* m = nullptr;
    for (const auto& c : models) m = c.name == name ? &c : m;
    ASSERT_NE(m, nullptr) << "no tiny model named " << name;
    std::string sha256;
    auto h = Load(*m, &sha256);
    ASSERT_TRUE(h.ok()) << h.status();
    ASSERT_EQ(sha256, f.at("sha256").string_value())
        << "the tiny model's bytes changed: re-run tests/data/record_arch_reference.py";
    EXPECT_EQ(h->model->hparams().architecture, m->options.architecture);

    const std::vector<int32_t> tokens = testing::Ints(f.at("tokens"));
    const float tolerance = m->options.weight_type == gguf::GgmlType::kF32 ? kF32Tolerance : kQuantTolerance;
    float worst = 0;
    if (!m->vocab.empty()) {  // a real vocabulary: llama.cpp's top 20 of each position
      EXPECT_EQ(h->model->hparams().n_vocab, static_cast<int64_t>(f.at("n_vocab").number_value()));
      const auto& top_ids = f.at("top_ids").list_value().values();
      const auto& top_logits = f.at("top_logits").list_value().values();
      ASSERT_EQ(top_ids.size(), tokens.size());
      ASSERT_TRUE(h->kv->CreateSession("one", "t").ok());
      int argmax_checked = 0;
      for (size_t i = 0; i < tokens.size(); ++i) {
        const std::vector<float> ours = h->Step("one", {tokens[i]});
        const std::vector<int32_t> ids = testing::Ints(top_ids[i]);
        const std::vector<float> theirs = testing::Floats(top_logits[i]);
        for (size_t k = 0; k < ids.size(); ++k) {
          const float diff = std::fabs(ours[ids[k]] - theirs[k]);
          EXPECT_LE(diff, tolerance) << "position " << i << " token " << ids[k];
          worst = std::max(worst, diff);
        }
        if (theirs[0] - theirs[1] > 2 * tolerance) {
          EXPECT_EQ(std::max_element(ours.begin(), ours.end()) - ours.begin(), ids[0]) << "position " << i;
          ++argmax_checked;
        }
      }
      std::printf(
          "%-20s %-8s vocab %lld: worst top-20 |logit - llama.cpp| = %.3g (tolerance %.0e), argmax "
          "equal at %d clear positions\n",
          name.c_str(), cpu::CpuKernelLevelName(GetParam()),
          static_cast<long long>(h->model->hparams().n_vocab), worst, tolerance, argmax_checked);
      continue;
    }
    std::vector<std::vector<float>> want;
    for (const auto& row : f.at("logits").list_value().values()) want.push_back(testing::Floats(row));
    ASSERT_EQ(want.size(), tokens.size());

    // One token per step: the decode path, every position.
    ASSERT_TRUE(h->kv->CreateSession("one", "t").ok());
    for (size_t i = 0; i < tokens.size(); ++i) {
      const float diff = MaxAbsDiff(h->Step("one", {tokens[i]}), want[i]);
      EXPECT_LE(diff, tolerance) << "position " << i;
      worst = std::max(worst, diff);
    }
    // All at once (prefill), and two chunks (the second attends to cached pages).
    ASSERT_TRUE(h->kv->CreateSession("all", "t").ok());
    const float all = MaxAbsDiff(h->Step("all", tokens), want.back());
    EXPECT_LE(all, tolerance);
    ASSERT_TRUE(h->kv->CreateSession("two", "t").ok());
    const std::vector<int32_t> head(tokens.begin(), tokens.begin() + 5),
        tail(tokens.begin() + 5, tokens.end());
    const float first = MaxAbsDiff(h->Step("two", head), want[4]);
    const float second = MaxAbsDiff(h->Step("two", tail), want.back());
    EXPECT_LE(first, tolerance);
    EXPECT_LE(second, tolerance);
    worst = std::max({worst, all, first, second});
    std::printf("%-12s %-8s worst |logit - llama.cpp| = %.3g (tolerance %.0e)\n", name.c_str(),
                cpu::CpuKernelLevelName(GetParam()), worst, tolerance);
  }
}

INSTANTIATE_TEST_SUITE_P(Levels, ArchReferenceTest, ::testing::ValuesIn(cpu::SupportedCpuKernelLevels()),
                         [](const auto& info) { return std::string(cpu::CpuKernelLevelName(info.param)); });

TEST(ArchitectureTest, OthersAreRefusedNamingWhatIsSupported) {
  gguf::TinyLlamaOptions o;
  auto bytes = gguf::BuildTinyLlama(o);
  ASSERT_TRUE(bytes.ok());
  // Rewrite the architecture value in place ("llama" -> "gemma", same length).
  const size_t at = bytes->find("llama");
  ASSERT_NE(at, std::string::npos);
  bytes->replace(at, 5, "gemma");
  auto file = gguf::GgufFile::OpenFromBuffer(*bytes);
  ASSERT_TRUE(file.ok()) << file.status();
  auto h = gguf::LoadLlamaHparams(**file);
  ASSERT_EQ(h.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_NE(h.status().message().find("'gemma'"), std::string::npos) << h.status();
  EXPECT_NE(h.status().message().find("llama, qwen2, qwen3"), std::string::npos) << h.status();
}

// A weight type no kernel decodes (Q3_K here: llama.cpp's Q3_K_S and Q2_K files
// hold it) is refused when the model loads, naming the tensor and the types
// that work, not by every request's first step (INTERNAL, on a worker that
// said it was ready).
TEST(ArchitectureTest, AWeightTypeNoKernelDecodesIsRefusedAtLoad) {
  gguf::TinyLlamaOptions o;
  o.n_embd = 256;  // a whole K-quant super-block per row
  o.n_ff = 512;
  o.type_overrides = {{"ffn_down.weight", gguf::GgmlType::kQ3_K}};
  auto bytes = gguf::BuildTinyLlama(o);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  auto file = gguf::GgufFile::OpenFromBuffer(*bytes);
  ASSERT_TRUE(file.ok()) << file.status();
  auto model = model::LlamaModel::FromFile(std::move(*file));
  ASSERT_EQ(model.status().code(), absl::StatusCode::kUnimplemented) << model.status();
  EXPECT_NE(model.status().message().find("blk.0.ffn_down.weight"), std::string::npos) << model.status();
  EXPECT_NE(model.status().message().find("q3_K"), std::string::npos) << model.status();
  EXPECT_NE(model.status().message().find("q6_K"), std::string::npos) << model.status();
}

}  // namespace
}  // namespace kvcache
