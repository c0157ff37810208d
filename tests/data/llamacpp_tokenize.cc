// Reference tool for record_tokenizer_corpus.py (not part of the build):
// tokenizes lines of "<add_special> <parse_special> <hex text>" from stdin with
// llama.cpp's own llama_tokenize on a vocabulary-only model, and prints the ids
// of each line; then, for every id in "pieces <id>..." lines, the hex of
// llama_token_to_piece(special = true) and (special = false); and for
// "detok <remove_special> <unparse_special> <id>..." lines, the hex of
// llama_detokenize of those ids.
#include <cstdio>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "llama.h"

static std::string FromHex(const std::string& h) {
  std::string out;
  for (size_t i = 0; i + 1 < h.size(); i += 2)
    out.push_back(static_cast<char>(std::stoi(h.substr(i, 2), nullptr, 16)));
  return out;
}

static std::string ToHex(const char* data, int n) {
  std::string hex;
  char tmp[3];
  for (int i = 0; i < n; ++i) {
    snprintf(tmp, sizeof(tmp), "%02x", static_cast<unsigned char>(data[i]));
    hex += tmp;
  }
  return hex;
}

static std::string Piece(const llama_vocab* vocab, llama_token id, bool special) {
  char buf[512];
  const int n = llama_token_to_piece(vocab, id, buf, sizeof(buf), 0, special);
  return ToHex(buf, n);
}

static std::string Detokenize(const llama_vocab* vocab, const std::vector<llama_token>& ids,
                              bool remove_special, bool unparse_special) {
  std::vector<char> buf(ids.size() * 16 + 64);
  int n = llama_detokenize(vocab, ids.data(), static_cast<int32_t>(ids.size()), buf.data(),
                           static_cast<int32_t>(buf.size()), remove_special, unparse_special);
  if (n < 0) {  // -n: the size it needs
    buf.resize(-n);
    n = llama_detokenize(vocab, ids.data(), static_cast<int32_t>(ids.size()), buf.data(),
                         static_cast<int32_t>(buf.size()), remove_special, unparse_special);
  }
  return ToHex(buf.data(), n);
}

int main(int argc, char** argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s VOCAB.gguf < requests\n", argv[0]);
    return 2;
  }
  llama_log_set([](ggml_log_level, const char*, void*) {}, nullptr);
  llama_backend_init();
  llama_model_params mp = llama_model_default_params();
  mp.vocab_only = true;
  llama_model* model = llama_model_load_from_file(argv[1], mp);
  if (model == nullptr) return 1;
  const llama_vocab* vocab = llama_model_get_vocab(model);
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string kind;
    in >> kind;
    if (kind == "pieces") {
      int id;
      while (in >> id) std::cout << Piece(vocab, id, true) << "," << Piece(vocab, id, false) << " ";
      std::cout << "\n";
      continue;
    }
    if (kind == "detok") {
      int remove, unparse, id;
      in >> remove >> unparse;
      std::vector<llama_token> ids;
      while (in >> id) ids.push_back(id);
      std::cout << Detokenize(vocab, ids, remove == 1, unparse == 1) << "\n";
      continue;
    }
    int parse;
    std::string hex;
    in >> parse >> hex;
    const std::string text = FromHex(hex);
    std::vector<llama_token> ids(text.size() * 2 + 8);
    const int n = llama_tokenize(vocab, text.data(), static_cast<int32_t>(text.size()), ids.data(),
                                 static_cast<int32_t>(ids.size()), kind == "1", parse == 1);
    for (int i = 0; i < n; ++i) std::cout << ids[i] << " ";
    std::cout << "\n";
  }
  llama_model_free(model);
  llama_backend_free();
  return 0;
}
