// Tokenizer built from a GGUF vocabulary, matching llama.cpp's `llama_tokenize`
// / `llama_token_to_piece` for
//   - byte-level BPE (`tokenizer.ggml.model = gpt2`) with the pre-tokenizers
//     "smollm" (SmolLM2, StarCoder, ...), "gpt-2", "llama-bpe" (Llama 3),
//     "qwen2" (Qwen 2.5 / Qwen3) and "tekken" (Mistral Nemo, Mistral Small 3,
//     Pixtral), and
//   - SentencePiece (`tokenizer.ggml.model = llama`: Llama 2, Mistral), with
//     score-driven merges, `<0xNN>` byte fallback and the leading-space prefix.
// Other models and pre-tokenizers are a clear UNIMPLEMENTED error at load time.
// FromGguf applies llama.cpp's per-model defaults (add_bos for SentencePiece,
// llama-bpe and tekken, add_space_prefix for SentencePiece) and then the GGUF
// keys that override them.
//
//   KVCACHE_ASSIGN_OR_RETURN(auto tok, Tokenizer::FromGguf(*file));
//   std::vector<int32_t> ids = tok->Encode(prompt, {.add_special = true,
//                                                   .parse_special = true});
//
// Thread-safety: immutable after construction; all const methods are safe
// from any number of threads concurrently.
#ifndef KVCACHE_COMMON_TOKENIZER_TOKENIZER_H_
#define KVCACHE_COMMON_TOKENIZER_TOKENIZER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/gguf/gguf_reader.h"

namespace kvcache {
namespace tok {

// GGUF `tokenizer.ggml.token_type` values (llama.cpp's llama_token_type).
enum class TokenType : int32_t {
  kUndefined = 0,
  kNormal = 1,
  kUnknown = 2,
  kControl = 3,
  kUserDefined = 4,
  kUnused = 5,
  kByte = 6,
};

// Everything a tokenizer is built from; FromGguf fills it from metadata.
struct VocabSpec {
  std::string model = "gpt2";          // tokenizer.ggml.model
  std::string pre = "smollm";          // tokenizer.ggml.pre
  std::vector<std::string> tokens;     // id -> text (byte-level encoded)
  std::vector<TokenType> token_types;  // empty: all kNormal
  std::vector<std::string> merges;     // "left right", rank = index (BPE)
  std::vector<float> scores;           // SentencePiece merge priority; empty: all 0
  int32_t bos_id = -1;
  int32_t eos_id = -1;
  int32_t eot_id = -1;  // end of turn; -1: none
  int32_t unk_id = -1;
  int32_t pad_id = -1;
  bool add_bos = false;  // tokenizer.ggml.add_bos_token
  bool add_eos = false;  // tokenizer.ggml.add_eos_token
  // SentencePiece: a space is prepended to text at the start and after every
  // special token (tokenizer.ggml.add_space_prefix).
  bool add_space_prefix = false;
};

struct EncodeOptions {
  // Add BOS/EOS when the vocabulary asks for them (add_bos / add_eos).
  bool add_special = true;
  // Match control tokens (e.g. "<|im_start|>") in the text. User-defined
  // tokens are always matched, as in llama.cpp.
  bool parse_special = false;
  // Byte ranges [begin, end) of `text` that are tokenised as with
  // parse_special = false even when parse_special is set: a control or
  // unknown token whose text overlaps one of them is not matched, and its
  // text is encoded as ordinary text (e.g. chat message content inside a
  // rendered template, ChatTemplate::Render's `content_spans`). The ranges do
  // not split the text: a text without control-token text in them encodes
  // exactly as without them. Any order; overlaps allowed. The caller keeps
  // the ranges alive for the call.
  absl::Span<const std::pair<size_t, size_t>> plain_spans = {};
};

class Tokenizer {
 public:
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromGguf(const gguf::GgufFile& file);
  // INVALID_ARGUMENT for an inconsistent spec (bad ids, malformed merges),
  // UNIMPLEMENTED for an unsupported model or pre-tokenizer.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> Create(VocabSpec spec);

  // Never fails: invalid UTF-8 bytes are encoded as U+FFFD (llama.cpp's rule).
  std::vector<int32_t> Encode(absl::string_view text, const EncodeOptions& options) const;

  // The bytes of one token, as llama_token_to_piece: control/unknown tokens
  // give their text when `special`, else nothing. The piece may end inside a
  // UTF-8 sequence (see StreamingDetokenizer). OUT_OF_RANGE for a bad id.
  absl::StatusOr<std::string> TokenToPiece(int32_t id, bool special) const;
  // Concatenated pieces. OUT_OF_RANGE for a bad id.
  absl::StatusOr<std::string> Decode(absl::Span<const int32_t> ids, bool special) const;

  int32_t n_vocab() const { return static_cast<int32_t>(tokens_.size()); }
  bool IsValid(int32_t id) const { return id >= 0 && id < n_vocab(); }
  int32_t bos_id() const { return spec_.bos_id; }
  int32_t eos_id() const { return spec_.eos_id; }
  // End of generation as llama.cpp decides it for the supported families:
  // EOS, EOT, the tokens named like an end marker ("<|im_end|>",
  // "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "</s>",
  // ...) and Qwen's FIM pad/repo/file-separator tokens. (llama.cpp also knows
  // markers of other families, e.g. gpt-oss's "<|return|>"; those are not
  // listed.)
  bool IsEndOfGeneration(int32_t id) const;
  // Every id IsEndOfGeneration accepts, ascending: what a generation stops on.
  const std::vector<int32_t>& eog_ids() const { return eog_ids_; }
  absl::string_view TokenText(int32_t id) const { return tokens_[id]; }  // REQUIRES: IsValid
  TokenType token_type(int32_t id) const { return types_[id]; }          // REQUIRES: IsValid
  // -1 when no token has exactly this text.
  int32_t FindToken(absl::string_view text) const;
  const VocabSpec& spec() const { return spec_; }

 private:
  struct Merge {
    int32_t rank;
    int32_t result;  // symbol id of the merged string
  };
  enum class PreKind { kGpt2, kSmollm, kLlama3, kQwen2, kTekken };

  Tokenizer() = default;
  absl::Status Init(VocabSpec spec);
  int32_t InternSymbol(const std::string& text);
  // Appends the BPE tokens of a fragment without special tokens.
  void EncodeFragment(absl::string_view text, std::vector<int32_t>* out) const;
  // Appends the BPE tokens of one pre-tokenized word (raw bytes).
  void EncodeWord(absl::string_view word, std::vector<int32_t>* out) const;
  // Appends the SentencePiece tokens of `text` (spaces already escaped).
  void EncodeSpm(absl::string_view text, std::vector<int32_t>* out) const;
  // The token of one raw byte: "<0xNN>", else the one-byte token; -1 if none.
  int32_t SpmByteToken(uint8_t b) const;

  VocabSpec spec_;
  bool spm_ = false;  // SentencePiece, else byte-level BPE
  PreKind pre_ = PreKind::kSmollm;
  // llama-bpe, tekken: a pre-tokenized word that is itself a token is emitted
  // whole, without running the merges (llama.cpp's ignore_merges).
  bool ignore_merges_ = false;
  std::vector<float> scores_;
  std::vector<std::string> tokens_;
  std::vector<TokenType> types_;
  // Symbols are token ids, plus ids >= n_vocab for merge strings that are not
  // tokens; symbol_text_ holds all of them.
  std::vector<std::string> symbol_text_;
  absl::flat_hash_map<std::string, int32_t> symbol_ids_;
  absl::flat_hash_map<uint64_t, Merge> merges_;  // (left << 32 | right) -> merge
  int32_t byte_symbol_[256];                     // symbol of each single byte; -1 none
  std::vector<int32_t> special_ids_;             // longest text first
  std::vector<bool> eog_;
  std::vector<int32_t> eog_ids_;
};

}  // namespace tok
}  // namespace kvcache

#endif  // KVCACHE_COMMON_TOKENIZER_TOKENIZER_H_
