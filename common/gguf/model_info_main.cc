// kvcache-model-info: prints what the worker will do with a GGUF model: its
// hyper-parameters and architecture features, tokenizer and chat template, tensor
// types with the CPU matmul route each takes, KV bytes per token and what the
// worker's KV budgets hold, and, optionally, the tokenisation of a string.
//
//   kvcache-model-info [--model PATH] [--tokenize "text"] [--parse_special]
//                      [--tier0_bytes N] [--tier1_bytes N] [--page_tokens N] [--kv_dtype T]
#include <cstdio>
#include <map>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "common/flags_usage.h"
#include "common/gguf/dequant_chunk.h"
#include "common/gguf/ggml_types.h"
#include "common/gguf/gguf_reader.h"
#include "common/gguf/llama_hparams.h"
#include "common/gguf/model_path.h"
#include "common/memory_limit.h"
#include "common/tokenizer/chat_template.h"
#include "common/tokenizer/tokenizer.h"
#include "worker/backend/cpu/matmul.h"
#include "worker/kv/kv_shape.h"
#include "worker/model/llama_model.h"
#include "worker/model/rope.h"

ABSL_FLAG(std::string, model, "", "GGUF model file (default: $KVCACHE_MODEL or the set-up cache)");
ABSL_FLAG(std::string, tokenize, "", "text to tokenise with the model's tokenizer");
ABSL_FLAG(bool, parse_special, true, "match control tokens such as <|im_start|> in --tokenize");
ABSL_FLAG(int64_t, tier0_bytes, int64_t{1} << 30, "KV budget of tier 0 to size against (the worker's flag)");
ABSL_FLAG(int64_t, tier1_bytes, int64_t{4} << 30, "KV budget of tier 1 to size against (the worker's flag)");
ABSL_FLAG(int32_t, page_tokens, 16, "tokens per KV page (the worker's flag)");
ABSL_FLAG(std::string, kv_dtype, "f16", "KV element type to size with: f16, bf16 or f32");

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
  kvcache::SetFlagsUsage(
      "Prints a GGUF model's hyper-parameters, tensor types and KV bytes per token.\n"
      "Usage: kvcache-model-info [--model PATH] [--tokenize TEXT]");
  std::vector<char*> rest = absl::ParseCommandLine(argc, argv);
  if (rest.size() > 1) {
    fprintf(stderr, "kvcache-model-info: unexpected argument '%s' (see --help)\n", rest[1]);
    return 2;
  }
  // The worker's own rules for the flags it sizes against.
  if (absl::Status st =
          kvcache::kv::ValidateBudgetFlags(absl::GetFlag(FLAGS_tier0_bytes), absl::GetFlag(FLAGS_tier1_bytes),
                                           absl::GetFlag(FLAGS_page_tokens));
      !st.ok()) {
    return Fail(st);
  }
  const absl::StatusOr<kvcache::kv::KvDtype> dtype = kvcache::kv::ParseDtype(absl::GetFlag(FLAGS_kv_dtype));
  if (!dtype.ok()) return Fail(dtype.status());
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

  struct TypeUse {
    GgmlType type;
    int count = 0;
    int64_t bytes = 0;
  };
  std::map<std::string, TypeUse> types;
  int64_t weight_bytes = 0;
  for (const auto& t : f.tensors()) {
    auto [it, added] = types.try_emplace(std::string(kvcache::gguf::TypeName(t.type)), TypeUse{t.type});
    ++it->second.count;
    it->second.bytes += t.size_bytes;
    weight_bytes += t.size_bytes;
  }
  printf("tensor types (CPU matmul route):\n");
  for (const auto& [name, e] : types) {
    const GgmlType type = e.type;
    const char* route = type == GgmlType::kF32 ? "f32 FMA kernel (norm weights are f32 too)"
                        : kvcache::cpu::IsIntegerDotType(type)
                            ? "integer dot with 8-bit activations, re-laid in 16-row groups at load"
                        : kvcache::gguf::TypeTraits(type).supported
                            ? "dequantised to f32 per call (slow path)"
                            : "NOT SUPPORTED: no kernel decodes it (the worker refuses the file)";
    printf("  %-8s %4d tensors %12lld bytes  %s\n", name.c_str(), e.count, static_cast<long long>(e.bytes),
           route);
  }
  printf("KV cache bytes per token (2 * layers * kv_heads * head_dim * size):\n");
  for (const auto& [name, size] : {std::pair<const char*, int>{"f32", 4}, {"f16", 2}, {"bf16", 2}}) {
    printf("  %-5s %lld\n", name, static_cast<long long>(hp->KvBytesPerToken(size)));
  }
  // What the worker's budgets hold: whole pages of page_tokens tokens.
  const int64_t elt = kvcache::kv::DtypeSize(*dtype);
  const int64_t page_tokens = absl::GetFlag(FLAGS_page_tokens);
  const int64_t page_bytes = hp->KvBytesPerToken(elt) * page_tokens;
  const int64_t window = hp->sliding_window > 0 ? hp->sliding_window : hp->n_ctx_train;
  printf("with --tier0_bytes=%lld --tier1_bytes=%lld --page_tokens=%lld --kv_dtype=%s (%lld bytes a page):\n",
         static_cast<long long>(absl::GetFlag(FLAGS_tier0_bytes)),
         static_cast<long long>(absl::GetFlag(FLAGS_tier1_bytes)), static_cast<long long>(page_tokens),
         kvcache::kv::DtypeName(*dtype), static_cast<long long>(page_bytes));
  for (const auto& [tier, bytes] :
       {std::pair<const char*, int64_t>{"tier 0", absl::GetFlag(FLAGS_tier0_bytes)},
        {"tier 1", absl::GetFlag(FLAGS_tier1_bytes)}}) {
    const int64_t pages = page_bytes > 0 ? bytes / page_bytes : 0;
    printf("  %s: %lld pages = %lld tokens = %.1f full contexts of %lld tokens\n", tier,
           static_cast<long long>(pages), static_cast<long long>(pages * page_tokens),
           window > 0 ? static_cast<double>(pages * page_tokens) / static_cast<double>(window) : 0.0,
           static_cast<long long>(window));
  }
  const int64_t context_pages = page_tokens > 0 ? (window + page_tokens - 1) / page_tokens : 0;
  if (page_bytes > 0 && absl::GetFlag(FLAGS_tier0_bytes) / page_bytes < context_pages) {
    printf("  note: tier 0 holds less than one full context; long requests will be refused or offloaded\n");
  }
  printf("weights: %lld bytes (mapped from the file on the CPU backend)\n",
         static_cast<long long>(weight_bytes));
  // The sum the worker checks against its memory limit at start (worker/main.cc).
  const auto file_bytes = static_cast<int64_t>(f.file_size());
  const int64_t host_cpu = kvcache::WorkerHostBytes(absl::GetFlag(FLAGS_tier0_bytes),
                                                    absl::GetFlag(FLAGS_tier1_bytes), file_bytes);
  const int64_t host_cuda = kvcache::WorkerHostBytes(0, absl::GetFlag(FLAGS_tier1_bytes), file_bytes);
  printf(
      "host memory: %lld bytes on the CPU backend (tier 0 + tier 1 + the file + %lld MiB for the process), "
      "%lld with tier 0 on a GPU\n",
      static_cast<long long>(host_cpu), static_cast<long long>(kvcache::kWorkerProcessBytes >> 20),
      static_cast<long long>(host_cuda));
  if (std::optional<kvcache::CgroupLimit> limit = kvcache::ProcessMemoryLimit()) {
    printf("  this container's memory limit: %lld bytes (%s)%s\n", static_cast<long long>(limit->bytes),
           limit->file.c_str(),
           host_cpu > limit->bytes
               ? ": a CPU worker refuses these budgets given, and shrinks them as defaults"
               : "");
  }
  // The CUDA runner uploads every matrix unchanged (worker/backend/cuda/weight_kernels.h).
  int64_t matrix_bytes = 0, matrix_f16_bytes = 0;
  bool device_reads_all = true;
  for (const auto& t : f.tensors()) {
    if (t.n_dims != 2) continue;
    matrix_bytes += t.size_bytes;
    matrix_f16_bytes += t.num_elements() * 2;
    device_reads_all = device_reads_all && kvcache::gguf::ChunkDecodable(t.type) && t.ne[0] % 8 == 0;
  }
  if (device_reads_all) {
    printf(
        "CUDA backend: %lld bytes of matrices in device memory, kept in the file's encoding (as f16: %lld)\n",
        static_cast<long long>(matrix_bytes), static_cast<long long>(matrix_f16_bytes));
  } else {
    printf("CUDA backend: cannot run this file (a matrix type or width its kernels do not read)\n");
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

  // What the worker does with the file at start: its weights (names, shapes,
  // types), RoPE and tokenizer, each of which it refuses the file over.
  absl::Status loads = tok.status();
  if (loads.ok()) {
    auto again = kvcache::gguf::OpenModelFile(path);
    auto model = again.ok() ? kvcache::model::LlamaModel::FromFile(std::move(*again))
                            : absl::StatusOr<std::unique_ptr<kvcache::model::LlamaModel>>(again.status());
    loads = model.ok() ? kvcache::model::RopeParamsFor((*model)->hparams(), (*model)->rope_freqs()).status()
                       : model.status();
  }
  printf("worker:            %s\n",
         loads.ok() ? "loads this file" : absl::StrCat("refuses this file: ", loads.ToString()).c_str());

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
  return loads.ok() ? 0 : 1;
}
