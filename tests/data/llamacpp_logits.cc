// Prints llama.cpp's logits for a token sequence, every position, as JSON:
//   llamacpp_logits MODEL.gguf 5,17,300,...
//   {"n_vocab": N, "logits": [[...], ...]}
// or, with --greedy N, llama.cpp's greedy continuation of the sequence (the
// prompt in one batch, then one token a step, up to N tokens or an
// end-of-generation token), the top-1 minus top-2 logit of every step, and the
// first step's 20 largest logits:
//   llamacpp_logits --greedy 48 MODEL.gguf 5,17,300,...
//   {"generated_ids": [...], "margins": [...], "stopped_at_eog": false,
//    "top20_ids": [...], "top20_logits": [...]}
// Built and run by tests/data/record_arch_reference.py and
// tests/data/record_requant_reference.py against the llama.cpp that
// tests/bench/build_llamacpp.sh builds (a recording tool, not part of the
// project's build). One sequence, f16 KV cache, one thread, no flash
// attention, no weight repacking: llama.cpp's plain CPU path.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "llama.h"

namespace {

// Decodes `tokens` at positions [pos, pos + n); logits for every token or the last only.
bool Decode(llama_context* ctx, const std::vector<llama_token>& tokens, int pos, bool all_logits) {
  const int n = static_cast<int>(tokens.size());
  llama_batch batch = llama_batch_init(n, 0, 1);
  for (int i = 0; i < n; ++i) {
    batch.token[i] = tokens[i];
    batch.pos[i] = pos + i;
    batch.n_seq_id[i] = 1;
    batch.seq_id[i][0] = 0;
    batch.logits[i] = all_logits || i + 1 == n;
  }
  batch.n_tokens = n;
  const bool ok = llama_decode(ctx, batch) == 0;
  llama_batch_free(batch);
  if (!ok) std::fprintf(stderr, "llama_decode failed\n");
  return ok;
}

void PrintInts(const char* key, const std::vector<int>& v) {
  std::printf("\"%s\": [", key);
  for (size_t i = 0; i < v.size(); ++i) std::printf("%s%d", i == 0 ? "" : ", ", v[i]);
  std::printf("]");
}

void PrintFloats(const char* key, const std::vector<float>& v) {
  std::printf("\"%s\": [", key);
  for (size_t i = 0; i < v.size(); ++i) std::printf("%s%.9g", i == 0 ? "" : ", ", v[i]);
  std::printf("]");
}

// Greedy continuation of `prompt`: see the file comment.
int Greedy(llama_context* ctx, const llama_vocab* vocab, const std::vector<llama_token>& prompt,
           int max_tokens) {
  if (!Decode(ctx, prompt, 0, false)) return 1;
  const int n_vocab = llama_vocab_n_tokens(vocab);
  std::vector<int> generated, top_ids;
  std::vector<float> margins, top_logits;
  bool eog = false;
  int pos = static_cast<int>(prompt.size());
  while (static_cast<int>(generated.size()) < max_tokens) {
    const float* row = llama_get_logits_ith(ctx, -1);
    std::vector<int> order(n_vocab);
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + 20, order.end(),
                      [row](int a, int b) { return row[a] > row[b] || (row[a] == row[b] && a < b); });
    if (generated.empty()) {
      top_ids.assign(order.begin(), order.begin() + 20);
      for (int id : top_ids) top_logits.push_back(row[id]);
    }
    generated.push_back(order[0]);
    margins.push_back(row[order[0]] - row[order[1]]);
    if (llama_vocab_is_eog(vocab, order[0])) {
      eog = true;
      break;
    }
    if (!Decode(ctx, {order[0]}, pos++, false)) return 1;
  }
  std::printf("{");
  PrintInts("generated_ids", generated);
  std::printf(", ");
  PrintFloats("margins", margins);
  std::printf(", \"stopped_at_eog\": %s, ", eog ? "true" : "false");
  PrintInts("top20_ids", top_ids);
  std::printf(", ");
  PrintFloats("top20_logits", top_logits);
  std::printf("}\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  int greedy = 0;
  if (argc == 5 && std::strcmp(argv[1], "--greedy") == 0) {
    greedy = std::atoi(argv[2]);
    argv += 2;
    argc -= 2;
  }
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s [--greedy N] MODEL.gguf TOKEN,TOKEN,...\n", argv[0]);
    return 2;
  }
  std::vector<llama_token> tokens;
  for (const char* p = argv[2]; *p != '\0';) {
    char* end = nullptr;
    tokens.push_back(static_cast<llama_token>(std::strtol(p, &end, 10)));
    p = *end == ',' ? end + 1 : end;
  }
  llama_backend_init();
  llama_model_params mp = llama_model_default_params();
  // No weight repacking: its AMX kernels crash on VMs that advertise AMX without
  // granting it (llama-server's --no-repack), and the plain CPU path is the one
  // every machine runs.
  mp.use_extra_bufts = false;
  llama_model* model = llama_model_load_from_file(argv[1], mp);
  if (model == nullptr) {
    std::fprintf(stderr, "cannot load %s\n", argv[1]);
    return 1;
  }
  llama_context_params cp = llama_context_default_params();
  cp.n_ctx = 256;
  cp.n_batch = 256;
  cp.n_ubatch = 256;
  cp.n_threads = 1;
  cp.n_threads_batch = 1;
  cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
  llama_context* ctx = llama_init_from_model(model, cp);
  if (ctx == nullptr) {
    std::fprintf(stderr, "cannot create a context\n");
    return 1;
  }
  int rc = 0;
  if (greedy > 0) {
    rc = Greedy(ctx, llama_model_get_vocab(model), tokens, greedy);
  } else if (Decode(ctx, tokens, 0, true)) {
    const int n = static_cast<int>(tokens.size());
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    std::printf("{\"n_vocab\": %d, \"logits\": [", n_vocab);
    for (int i = 0; i < n; ++i) {
      const float* row = llama_get_logits_ith(ctx, i);
      std::printf("%s[", i == 0 ? "" : ", ");
      for (int v = 0; v < n_vocab; ++v) std::printf("%s%.9g", v == 0 ? "" : ", ", row[v]);
      std::printf("]");
    }
    std::printf("]}\n");
  } else {
    rc = 1;
  }
  llama_free(ctx);
  llama_model_free(model);
  llama_backend_free();
  return rc;
}
