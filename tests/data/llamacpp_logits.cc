// Prints llama.cpp's logits for a token sequence, every position, as JSON:
//   llamacpp_logits MODEL.gguf 5,17,300,...
//   {"n_vocab": N, "logits": [[...], ...]}
// Built and run by tests/data/record_arch_reference.py against the llama.cpp
// that tests/bench/build_llamacpp.sh builds (a recording tool, not part of the
// project's build). One sequence, one batch, f16 KV cache, one thread, no flash
// attention, no weight repacking: llama.cpp's plain CPU path.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "llama.h"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s MODEL.gguf TOKEN,TOKEN,...\n", argv[0]);
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
  const int n = static_cast<int>(tokens.size());
  llama_batch batch = llama_batch_init(n, 0, 1);
  for (int i = 0; i < n; ++i) {
    batch.token[i] = tokens[i];
    batch.pos[i] = i;
    batch.n_seq_id[i] = 1;
    batch.seq_id[i][0] = 0;
    batch.logits[i] = 1;
  }
  batch.n_tokens = n;
  if (llama_decode(ctx, batch) != 0) {
    std::fprintf(stderr, "llama_decode failed\n");
    return 1;
  }
  const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
  std::printf("{\"n_vocab\": %d, \"logits\": [", n_vocab);
  for (int i = 0; i < n; ++i) {
    const float* row = llama_get_logits_ith(ctx, i);
    std::printf("%s[", i == 0 ? "" : ", ");
    for (int v = 0; v < n_vocab; ++v) std::printf("%s%.9g", v == 0 ? "" : ", ", row[v]);
    std::printf("]");
  }
  std::printf("]}\n");
  llama_batch_free(batch);
  llama_free(ctx);
  llama_model_free(model);
  llama_backend_free();
  return 0;
}
