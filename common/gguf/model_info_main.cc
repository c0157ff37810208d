// kvcache-model-info: prints a GGUF model's hyper-parameters, tensor types,
// KV-cache bytes per token and, optionally, the tokenisation of a string.
//
//   kvcache-model-info [--model PATH] [--tokenize "text"] [--parse_special]
#include <cstdio>
#include <map>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "common/gguf/ggml_types.h"
#include "common/gguf/gguf_reader.h"
#include "common/gguf/llama_hparams.h"
#include "common/gguf/model_path.h"
#include "common/tokenizer/chat_template.h"
#include "common/tokenizer/tokenizer.h"

ABSL_FLAG(std::string, model, "", "GGUF model file (default: $KVCACHE_MODEL or the set-up cache)");
ABSL_FLAG(std::string, tokenize, "", "text to tokenise with the model's tokenizer");
ABSL_FLAG(bool, parse_special, true, "match control tokens such as <|im_start|> in --tokenize");

namespace {

using kvcache::gguf::GgmlType;

int Fail(const absl::Status& s) {
  fprintf(stderr, "kvcache-model-info: %s\n", std::string(s.ToString()).c_str());
  return 1;
}

std::string Escape(const std::string& s) {
  std::string out;
  for (unsigned char c : s) {
    if (c == '\n') {
      out += "\\n";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c < 0x20) {
      out += absl::StrCat("\\x", absl::Hex(c, absl::kZeroPad2));
    } else {
      out.push_back(static_cast<char>(c));
    }
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Prints a GGUF model's hyper-parameters, tensor types and KV bytes per token.\n"
      "Usage: kvcache-model-info [--model PATH] [--tokenize TEXT]");
  std::vector<char*> rest = absl::ParseCommandLine(argc, argv);
  if (rest.size() > 1) {
    fprintf(stderr, "kvcache-model-info: unexpected argument '%s' (see --help)\n", rest[1]);
    return 2;
  }
  std::string path = absl::GetFlag(FLAGS_model);
  if (path.empty()) path = kvcache::gguf::DefaultModelPath();

  auto file = kvcache::gguf::OpenModelFile(path);
  if (!file.ok()) return Fail(file.status());
  const kvcache::gguf::GgufFile& f = **file;
  printf("file: %s (%zu bytes, GGUF v%u, alignment %u, %zu metadata keys, %zu tensors)\n", path.c_str(),
         f.file_size(), f.version(), f.alignment(), f.metadata().size(), f.tensors().size());

  auto hp = kvcache::gguf::LoadLlamaHparams(f);
  if (!hp.ok()) return Fail(hp.status());
  printf("name:              %s\n", hp->name.c_str());
  printf("architecture:      %s\n", hp->architecture.c_str());
  printf("layers:            %lld\n", static_cast<long long>(hp->n_layer));
  printf("embedding:         %lld\n", static_cast<long long>(hp->n_embd));
  printf("feed_forward:      %lld\n", static_cast<long long>(hp->n_ff));
  printf("heads / kv heads:  %lld / %lld (GQA ratio %lld)\n", static_cast<long long>(hp->n_head),
         static_cast<long long>(hp->n_head_kv), static_cast<long long>(hp->gqa_ratio()));
  printf("head_dim:          %lld (rope dims %lld)\n", static_cast<long long>(hp->head_dim),
         static_cast<long long>(hp->n_rot));
  printf("context (train):   %lld\n", static_cast<long long>(hp->n_ctx_train));
  printf("vocab:             %lld\n", static_cast<long long>(hp->n_vocab));
  printf("rope base:         %g (scaling %s x%g)\n", hp->rope_freq_base, hp->rope_scaling.type.c_str(),
         hp->rope_scaling.factor);
  printf("rms norm eps:      %g\n", hp->norm_rms_eps);
  printf("sliding window:    %lld\n", static_cast<long long>(hp->sliding_window));
  printf("tied embeddings:   %s\n", hp->tied_embeddings ? "yes" : "no");
  printf("rope style:        %s%s\n",
         hp->rope_neox ? "neox (pairs half a head apart)" : "norm (adjacent pairs)",
         hp->has_rope_freqs ? ", rope_freqs factors (Llama 3.1)" : "");
  printf("q/k/v biases:      %s\n", hp->qkv_bias ? "yes" : "no");
  printf("q/k head norms:    %s\n", hp->qk_norm ? "yes" : "no");

  std::map<std::string, std::pair<int, int64_t>> types;
  for (const auto& t : f.tensors()) {
    auto& e = types[std::string(kvcache::gguf::TypeName(t.type))];
    ++e.first;
    e.second += t.size_bytes;
  }
  printf("tensor types:\n");
  for (const auto& [name, e] : types) {
    printf("  %-8s %4d tensors %12lld bytes\n", name.c_str(), e.first, static_cast<long long>(e.second));
  }
  printf("KV cache bytes per token (2 * layers * kv_heads * head_dim * size):\n");
  for (const auto& [name, size] : {std::pair<const char*, int>{"f32", 4}, {"f16", 2}, {"bf16", 2}}) {
    printf("  %-5s %lld\n", name, static_cast<long long>(hp->KvBytesPerToken(size)));
  }

  auto tok = kvcache::tok::Tokenizer::FromGguf(f);
  if (!tok.ok()) {
    printf("tokenizer:         unavailable (%s)\n", std::string(tok.status().message()).c_str());
  } else {
    printf("tokenizer:         %s / %s, %d tokens, bos %d, eos %d, add_bos %s\n",
           (*tok)->spec().model.c_str(), (*tok)->spec().pre.c_str(), (*tok)->n_vocab(), (*tok)->bos_id(),
           (*tok)->eos_id(), (*tok)->spec().add_bos ? "yes" : "no");
  }
  auto chat = kvcache::tok::ChatTemplate::FromGguf(f);
  printf("chat template:     %s\n", chat.ok() ? kvcache::tok::ChatTemplate::KindName(chat->kind())
                                              : std::string(chat.status().message()).c_str());

  const std::string text = absl::GetFlag(FLAGS_tokenize);
  if (!text.empty()) {
    if (!tok.ok()) return Fail(tok.status());
    kvcache::tok::EncodeOptions opts;
    opts.parse_special = absl::GetFlag(FLAGS_parse_special);
    const std::vector<int32_t> ids = (*tok)->Encode(text, opts);
    printf("tokens (%zu):\n", ids.size());
    for (int32_t id : ids) {
      printf("  %6d  '%s'\n", id, Escape((*tok)->TokenToPiece(id, true).value()).c_str());
    }
  }
  return 0;
}
