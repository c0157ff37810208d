// kvcache-llamacpp-requantize: re-quantises a GGUF as llama.cpp's
// `llama-quantize --allow-requantize IN OUT TYPE` does, so that the tests can
// check our kernels on the quantisation types users deploy (Q4_K_M, Q6_K,
// Q4_0, Q8_0) without building llama.cpp in CI (19 minutes on 2 cores).
//
// The numbers are llama.cpp's own: every tensor is dequantised by ggml's
// `to_float` and quantised by `ggml_quantize_chunk`, compiled from ggml.c and
// ggml-quants.c of the llama.cpp source that scripts/fetch_llamacpp_src.sh
// unpacks (the llama-cpp-python sdist's). What this file adds is the choice of
// each tensor's type, ported from llama.cpp's src/llama-quant.cpp
// (llama_tensor_get_type) for dense Llama-family models without an importance
// matrix. requantized_reference_test checks every tensor's type and bytes
// against what llama-quantize itself wrote (tests/data/requant_reference.json),
// so a wrong port fails there.
//
//   kvcache-llamacpp-requantize --in MODEL.gguf --out OUT.gguf --type Q4_K_M
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/gguf/gguf_reader.h"
#include "common/gguf/gguf_writer.h"
#include "common/gguf/model_path.h"
#include "ggml.h"

ABSL_FLAG(std::string, in, "", "GGUF to re-quantise (default: the default model, $KVCACHE_MODEL).");
ABSL_FLAG(std::string, out, "", "GGUF to write.");
ABSL_FLAG(std::string, type, "Q4_K_M", "llama-quantize's type name: Q4_K_M, Q6_K, Q4_0 or Q8_0.");

namespace kvcache {
namespace {

// A llama.cpp file type (llama_ftype) and the tensor type it starts from.
struct FileType {
  const char* name;
  uint32_t llama_ftype;
  ggml_type default_type;
};

constexpr FileType kFileTypes[] = {
    {"Q4_K_M", 15, GGML_TYPE_Q4_K},
    {"Q6_K", 18, GGML_TYPE_Q6_K},
    {"Q4_0", 2, GGML_TYPE_Q4_0},
    {"Q8_0", 7, GGML_TYPE_Q8_0},
};

// The layer of "blk.N.*", -1 for other names.
int LayerOf(const std::string& name) {
  int layer = -1;
  std::sscanf(name.c_str(), "blk.%d.", &layer);
  return layer;
}

// llama-quant.cpp's use_more_bits: the first and last eighth of the layers and
// every third layer between them.
bool UseMoreBits(int i, int n) { return i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2; }

// llama-quant.cpp's tensor_type_fallback: a type whose block does not divide
// the row length falls back to a 32-block type, else F16.
ggml_type Fallback(ggml_type type, int64_t ncols) {
  if (ncols % ggml_blck_size(type) == 0) return type;
  ggml_type fallback = type;
  switch (type) {
    case GGML_TYPE_Q4_K:
      fallback = GGML_TYPE_Q5_0;
      break;
    case GGML_TYPE_Q5_K:
      fallback = GGML_TYPE_Q5_1;
      break;
    case GGML_TYPE_Q6_K:
      fallback = GGML_TYPE_Q8_0;
      break;
    default:
      break;
  }
  return ncols % ggml_blck_size(fallback) == 0 ? fallback : GGML_TYPE_F16;
}

// Chooses each tensor's type as llama_tensor_get_type does for the file types
// above on a dense model. Counters advance in llama.cpp's tensor order (layer,
// then name), which is the order Plan() is called in.
class TypePolicy {
 public:
  TypePolicy(const FileType& ft, int n_layer, int n_attention_v, bool tied_embeddings)
      : ft_(ft), n_layer_(n_layer), n_attention_v_(n_attention_v), tied_(tied_embeddings) {}

  ggml_type Plan(const gguf::GgufTensorInfo& t) {
    const std::string& name = t.name;
    const ggml_type current = static_cast<ggml_type>(t.type);
    const bool quantizable =
        t.n_dims >= 2 && absl::EndsWith(name, "weight") && !absl::StrContains(name, "_norm.weight");
    if (!quantizable) return current;
    const bool q4_k_m = ft_.llama_ftype == 15;
    ggml_type type = ft_.default_type;
    if (name == "output.weight" || (tied_ && name == "token_embd.weight")) {
      if (t.ne[0] % ggml_blck_size(type) != 0) {
        type = GGML_TYPE_Q8_0;
      } else if (type != GGML_TYPE_Q8_0) {
        type = GGML_TYPE_Q6_K;
      }
    } else if (absl::StrContains(name, "attn_v.weight") || absl::StrContains(name, "attn_qkv.weight")) {
      if (absl::StrContains(name, "attn_qkv.weight")) {
        if (q4_k_m) type = GGML_TYPE_Q5_K;
      } else if (q4_k_m && UseMoreBits(i_attention_v_, n_attention_v_)) {
        type = GGML_TYPE_Q6_K;
      }
      ++i_attention_v_;
    } else if (absl::StrContains(name, "ffn_down")) {
      if (q4_k_m && UseMoreBits(i_ffn_down_, n_layer_)) type = GGML_TYPE_Q6_K;
      ++i_ffn_down_;
    }
    return Fallback(type, t.ne[0]);
  }

 private:
  const FileType ft_;
  const int n_layer_;
  const int n_attention_v_;
  const bool tied_;
  int i_attention_v_ = 0;
  int i_ffn_down_ = 0;
};

absl::StatusOr<uint64_t> BlockCount(const gguf::GgufFile& file) {
  auto arch = file.GetString("general.architecture");
  if (!arch.ok()) return arch.status();
  return file.GetUint64(absl::StrCat(*arch, ".block_count"));
}

absl::Status Requantize(const std::string& in, const std::string& out, const std::string& type_name) {
  const FileType* ft = nullptr;
  for (const FileType& f : kFileTypes) {
    if (type_name == f.name) ft = &f;
  }
  if (ft == nullptr) return absl::InvalidArgumentError(absl::StrCat("unsupported --type ", type_name));
  auto file = gguf::GgufFile::Open(in);
  if (!file.ok()) return file.status();
  auto n_layer = BlockCount(**file);
  if (!n_layer.ok()) return n_layer.status();
  if ((*file)->FindValue(absl::StrCat(*(*file)->GetString("general.architecture"), ".expert_count")) !=
          nullptr ||
      *n_layer == 80) {
    // llama.cpp has extra rules for mixtures of experts and 70B models.
    return absl::UnimplementedError("only dense models without llama.cpp's 70B rules are ported");
  }

  // llama.cpp's order: by layer (non-layer tensors first), then by name.
  std::vector<const gguf::GgufTensorInfo*> tensors;
  int n_attention_v = 0;
  bool tied = true;
  for (const auto& t : (*file)->tensors()) {
    tensors.push_back(&t);
    n_attention_v +=
        absl::StrContains(t.name, "attn_v.weight") || absl::StrContains(t.name, "attn_qkv.weight");
    tied &= t.name != "output.weight";
  }
  std::sort(tensors.begin(), tensors.end(), [](const gguf::GgufTensorInfo* a, const gguf::GgufTensorInfo* b) {
    const int la = LayerOf(a->name), lb = LayerOf(b->name);
    return la != lb ? la < lb : a->name < b->name;
  });

  gguf::GgufWriter writer((*file)->alignment());
  for (const auto& [key, value] : (*file)->metadata()) {
    if (key == "general.file_type" || key == "general.quantization_version" || key == "general.alignment")
      continue;
    if (absl::Status s = writer.CopyValue(key, value); !s.ok()) return s;
  }
  writer.AddUint32("general.quantization_version", GGML_QNT_VERSION);
  writer.AddUint32("general.file_type", ft->llama_ftype);

  TypePolicy policy(*ft, static_cast<int>(*n_layer), n_attention_v, tied);
  std::vector<float> f32;
  for (const gguf::GgufTensorInfo* t : tensors) {
    const ggml_type from = static_cast<ggml_type>(t->type);
    const ggml_type to = policy.Plan(*t);
    const std::vector<int64_t> shape(t->ne.begin(), t->ne.begin() + t->n_dims);
    const int64_t n_per_row = t->ne[0];
    const int64_t nrows = t->num_rows();
    std::string data;
    if (to == from) {
      data.assign(reinterpret_cast<const char*>(t->data), t->size_bytes);
    } else {
      const int64_t n = t->num_elements();
      f32.resize(n);
      if (from == GGML_TYPE_F32) {
        std::copy_n(reinterpret_cast<const float*>(t->data), n, f32.data());
      } else if (ggml_get_type_traits(from)->to_float != nullptr) {
        ggml_get_type_traits(from)->to_float(t->data, f32.data(), n);
      } else {
        return absl::UnimplementedError(absl::StrCat(t->name, ": cannot dequantise ", ggml_type_name(from)));
      }
      data.resize(ggml_row_size(to, n_per_row) * nrows);
      const size_t written = ggml_quantize_chunk(to, f32.data(), data.data(), 0, nrows, n_per_row, nullptr);
      if (written != data.size()) return absl::InternalError(absl::StrCat(t->name, ": short quantisation"));
    }
    if (absl::Status s = writer.AddTensor(t->name, static_cast<gguf::GgmlType>(to), shape, std::move(data));
        !s.ok()) {
      return s;
    }
  }
  return writer.WriteToFile(out);
}

}  // namespace
}  // namespace kvcache

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  std::string in = absl::GetFlag(FLAGS_in);
  if (in.empty()) in = kvcache::gguf::DefaultModelPath();
  const std::string out = absl::GetFlag(FLAGS_out);
  if (out.empty()) {
    std::fprintf(stderr, "usage: %s [--in MODEL.gguf] --out OUT.gguf --type Q4_K_M|Q6_K|Q4_0|Q8_0\n",
                 argv[0]);
    return 2;
  }
  const absl::Status s = kvcache::Requantize(in, out, absl::GetFlag(FLAGS_type));
  if (!s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
