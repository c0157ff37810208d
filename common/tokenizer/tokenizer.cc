#include "common/tokenizer/tokenizer.h"

#include <algorithm>
#include <queue>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "common/status_macros.h"
#include "common/tokenizer/unicode.h"

namespace kvcache {
namespace tok {
namespace {

constexpr uint8_t kSentinel = 0x80;  // "outside the piece" flag for the splitter

bool IsSpecialType(TokenType t) {
  return t == TokenType::kControl || t == TokenType::kUserDefined || t == TokenType::kUnknown;
}

// GPT-2 pre-tokenizer regex, hand-written:
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// over code points [b, e) of a piece; calls emit(begin, end) per word. The
// piece edge is a hard boundary (lookahead sees nothing past it).
template <typename Emit>
void SplitGpt2(const uint32_t* cps, const uint8_t* flags, size_t b, size_t e, Emit&& emit) {
  auto flag_at = [&](size_t i) -> uint8_t { return i < e ? flags[i] : kSentinel; };
  auto other = [](uint8_t f) {  // [^\s\p{L}\p{N}] inside the piece
    return (f & (kWhitespace | kLetter | kNumber | kSentinel)) == 0;
  };
  size_t pos = b;
  while (pos < e) {
    const uint32_t cp = cps[pos];
    if (cp == '\'' && pos + 1 < e) {
      const uint32_t n1 = cps[pos + 1];
      if (n1 == 's' || n1 == 't' || n1 == 'm' || n1 == 'd') {
        emit(pos, pos + 2);
        pos += 2;
        continue;
      }
      if (pos + 2 < e) {
        const uint32_t n2 = cps[pos + 2];
        if ((n1 == 'r' && n2 == 'e') || (n1 == 'v' && n2 == 'e') || (n1 == 'l' && n2 == 'l')) {
          emit(pos, pos + 3);
          pos += 3;
          continue;
        }
      }
    }
    const size_t start = pos;
    const uint8_t f2 = cp == ' ' ? flag_at(pos + 1) : flags[pos];
    const size_t body = pos + (cp == ' ' ? 1 : 0);
    if (f2 & kLetter) {
      pos = body;
      while (flag_at(pos) & kLetter) ++pos;
      emit(start, pos);
      continue;
    }
    if (f2 & kNumber) {
      pos = body;
      while (flag_at(pos) & kNumber) ++pos;
      emit(start, pos);
      continue;
    }
    if (other(f2)) {
      pos = body;
      while (other(flag_at(pos))) ++pos;
      emit(start, pos);
      continue;
    }
    size_t n_ws = 0;
    while (flag_at(pos + n_ws) & kWhitespace) ++n_ws;
    if (n_ws > 1 && pos + n_ws < e) {  // \s+(?!\S): leave the last one for the next word
      pos += n_ws - 1;
    } else if (n_ws > 0) {
      pos += n_ws;
    } else {
      ++pos;
    }
    emit(start, pos);
  }
}

// The pre-tokenizer regexes of the Llama 3 family, which differ only in a few
// alternatives:
//   Llama 3 / Qwen2:
//     (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,D}|
//      ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
//   with D = 3 (Llama 3) or 1 (Qwen2);
//   Tekken (Mistral Nemo), as llama.cpp adapts it for std::regex:
//     [^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+|
//     [^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*|\p{N}|
//      ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+
struct SplitRules {
  bool contractions;  // the leading (?i:'s|...) alternative
  // Tekken's two letter alternatives instead of [^\r\n\p{L}\p{N}]?\p{L}+.
  // "Upper" is a letter that is not a-z, "lower" one that is not A-Z: a
  // non-ASCII letter is both, whatever its case (llama.cpp runs this regex
  // on text where every non-ASCII letter is one placeholder byte).
  bool case_words;
  size_t max_digits;  // \p{N}{1,max_digits}
  bool slash_tail;    // [\r\n/]* after punctuation, else [\r\n]*
};
constexpr SplitRules kLlama3Rules = {true, false, 3, false};
constexpr SplitRules kQwen2Rules = {true, false, 1, false};
constexpr SplitRules kTekkenRules = {false, true, 1, true};

// One of those regexes, hand-written, over code points [b, e) of a piece,
// trying the alternatives in order as llama.cpp's matchers do
// (unicode_regex_split_custom_llama3 / _qwen2; std::regex for Tekken).
template <typename Emit>
void SplitLlama3(const uint32_t* cps, const uint8_t* flags, size_t b, size_t e, const SplitRules& rules,
                 Emit&& emit) {
  auto flag_at = [&](size_t i) -> uint8_t { return i < e ? flags[i] : kSentinel; };
  auto cp_at = [&](size_t i) -> uint32_t { return i < e ? cps[i] : 0xFFFFFFFFu; };
  auto lower = [](uint32_t c) { return c >= 'A' && c <= 'Z' ? c + 32 : c; };
  auto is_letter = [&](size_t i) { return (flag_at(i) & (kLetter | kSentinel)) == kLetter; };
  auto is_number = [&](size_t i) { return (flag_at(i) & (kNumber | kSentinel)) == kNumber; };
  auto is_space = [&](size_t i) { return (flag_at(i) & (kWhitespace | kSentinel)) == kWhitespace; };
  auto is_upper = [&](size_t i) { return is_letter(i) && !(cps[i] >= 'a' && cps[i] <= 'z'); };
  auto is_lower = [&](size_t i) { return is_letter(i) && !(cps[i] >= 'A' && cps[i] <= 'Z'); };
  // [^\s\p{L}\p{N}] inside the piece.
  auto other = [](uint8_t f) { return (f & (kWhitespace | kLetter | kNumber | kSentinel)) == 0; };
  auto is_tail = [&](uint32_t c) { return c == '\r' || c == '\n' || (rules.slash_tail && c == '/'); };
  size_t prev = b;
  auto add = [&](size_t end) {
    if (end > prev) emit(prev, end);
    prev = end;
  };
  size_t pos = b;
  while (pos < e) {
    const uint32_t cp = cps[pos];
    if (rules.contractions && cp == '\'' && pos + 1 < e) {
      const uint32_t n1 = lower(cps[pos + 1]);
      if (n1 == 's' || n1 == 't' || n1 == 'm' || n1 == 'd') {
        pos += 2;
        add(pos);
        continue;
      }
      if (pos + 2 < e) {
        const uint32_t n2 = lower(cps[pos + 2]);
        if ((n1 == 'r' && n2 == 'e') || (n1 == 'v' && n2 == 'e') || (n1 == 'l' && n2 == 'l')) {
          pos += 3;
          add(pos);
          continue;
        }
      }
    }
    // [^\r\n\p{L}\p{N}]? before a word: taken when it is there.
    const size_t word = pos + (cp == '\r' || cp == '\n' || is_number(pos) || is_letter(pos) ? 0 : 1);
    if (rules.case_words) {
      // upper* lower+: lower+ starts at the last lower letter at or after
      // the start of the upper run and at most one past its end; when that
      // letter is inside the run (a non-ASCII letter, which counts as both
      // cases), lower+ is that letter alone ...
      size_t upper_end = word;
      while (is_upper(upper_end)) ++upper_end;
      size_t lower_start = upper_end + 1;
      while (lower_start > word && !is_lower(lower_start - 1)) --lower_start;
      if (lower_start > word) {
        pos = lower_start;
        while (is_lower(pos)) ++pos;
        add(pos);
        continue;
      }
      // ... else upper+ lower* (lower* is empty here).
      if (upper_end > word) {
        pos = upper_end;
        add(pos);
        continue;
      }
    } else if (is_letter(word)) {  // \p{L}+
      pos = word;
      while (is_letter(pos)) ++pos;
      add(pos);
      continue;
    }
    // \p{N}{1,max_digits}
    if (is_number(pos)) {
      size_t run = 0;
      while (is_number(pos)) {
        ++pos;
        if (++run == rules.max_digits) {
          add(pos);
          run = 0;
        }
      }
      add(pos);
      continue;
    }
    // " ?[^\s\p{L}\p{N}]+[\r\n]*" (or [\r\n/]*)
    const uint8_t f2 = cp == ' ' ? flag_at(pos + 1) : flags[pos];
    if ((f2 & (kWhitespace | kLetter | kNumber)) == 0) {
      if (cp == ' ') ++pos;
      while (other(flag_at(pos))) ++pos;
      while (is_tail(cp_at(pos))) ++pos;
      add(pos);
      continue;
    }
    size_t n_ws = 0;
    size_t last_newline_end = 0;
    while (is_space(pos + n_ws)) {
      const uint32_t c = cps[pos + n_ws];
      if (c == '\r' || c == '\n') last_newline_end = pos + n_ws + 1;
      ++n_ws;
    }
    if (last_newline_end > 0) {  // \s*[\r\n]+
      pos = last_newline_end;
    } else if (n_ws > 1 && pos + n_ws < e) {  // \s+(?!\S): leave the last one for the next word
      pos += n_ws - 1;
    } else if (n_ws > 0) {  // \s+
      pos += n_ws;
    } else {
      ++pos;
    }
    add(pos);
  }
}

// Length llama.cpp gives the UTF-8 sequence starting with `lead` when it
// splits text into characters (a stray byte counts as one).
size_t CharLength(uint8_t lead) {
  static constexpr uint8_t kLengths[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
  return kLengths[lead >> 4];
}

// Sorted, disjoint, non-empty copies of `spans`.
std::vector<std::pair<size_t, size_t>> MergeSpans(absl::Span<const std::pair<size_t, size_t>> spans) {
  std::vector<std::pair<size_t, size_t>> out;
  for (const auto& s : spans) {
    if (s.first < s.second) out.push_back(s);
  }
  std::sort(out.begin(), out.end());
  size_t n = 0;
  for (const auto& s : out) {
    if (n > 0 && s.first <= out[n - 1].second) {
      out[n - 1].second = std::max(out[n - 1].second, s.second);
    } else {
      out[n++] = s;
    }
  }
  out.resize(n);
  return out;
}

// Whether [begin, end) overlaps one of `spans` (as MergeSpans returns them).
bool OverlapsAny(const std::vector<std::pair<size_t, size_t>>& spans, size_t begin, size_t end) {
  // The first span that ends after `begin`; the ends ascend.
  auto it = std::upper_bound(spans.begin(), spans.end(), begin,
                             [](size_t b, const std::pair<size_t, size_t>& s) { return b < s.second; });
  return it != spans.end() && it->first < end;
}

// Token texts llama.cpp treats as end-of-generation or FIM control tokens
// whatever their GGUF type (it forces them to control).
bool IsForcedControlText(absl::string_view s) {
  static constexpr absl::string_view kTexts[] = {"<|eot_id|>",     "<|im_end|>",     "<|end|>",
                                                 "<end_of_turn>",  "<|endoftext|>",  "<|end_of_text|>",
                                                 "<EOT>",          "_<EOT>",         "</s>",
                                                 "<|eom_id|>",     "<|fim_prefix|>", "<|fim_suffix|>",
                                                 "<|fim_middle|>", "<|fim_pad|>",    "<|repo_name|>",
                                                 "<|fim_repo|>",   "<|file_sep|>",   "<end_of_utterance>"};
  for (absl::string_view t : kTexts) {
    if (s == t) return true;
  }
  return false;
}

// llama.cpp's end-of-generation texts (special_eog_ids), plus Qwen's FIM
// pad / repo / file-separator tokens that it also counts as EOG.
bool IsEogText(absl::string_view s) {
  static constexpr absl::string_view kTexts[] = {
      "<|eot_id|>",    "<|im_end|>",   "<|end|>",     "<end_of_turn>",   "<|endoftext|>",      "</s>",
      "<|eom_id|>",    "<EOT>",        "_<EOT>",      "<|end_of_text|>", "<end_of_utterance>", "<|fim_pad|>",
      "<|repo_name|>", "<|fim_repo|>", "<|file_sep|>"};
  for (absl::string_view t : kTexts) {
    if (s == t) return true;
  }
  return false;
}

struct Bigram {
  int32_t rank;
  int32_t left;   // symbol index
  int32_t right;  // symbol index
  int32_t left_sym, right_sym;
  bool operator<(const Bigram& o) const {  // priority_queue pops the largest
    return rank != o.rank ? rank > o.rank : left > o.left;
  }
};

}  // namespace

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromGguf(const gguf::GgufFile& file) {
  VocabSpec spec;
  KVCACHE_ASSIGN_OR_RETURN(absl::string_view model, file.GetString("tokenizer.ggml.model"));
  spec.model = std::string(model);
  if (auto pre = file.GetString("tokenizer.ggml.pre"); pre.ok()) {
    spec.pre = std::string(*pre);
  } else {
    spec.pre = "default";
  }
  const gguf::GgufValue* tokens = file.FindValue("tokenizer.ggml.tokens");
  if (tokens == nullptr) {
    return absl::InvalidArgumentError("GGUF has no tokenizer.ggml.tokens");
  }
  KVCACHE_ASSIGN_OR_RETURN(auto token_views, tokens->AsStringArray());
  for (absl::string_view v : token_views) spec.tokens.emplace_back(v);
  if (const gguf::GgufValue* types = file.FindValue("tokenizer.ggml.token_type")) {
    KVCACHE_ASSIGN_OR_RETURN(auto raw_types, types->AsIntArray());
    spec.token_types.reserve(raw_types.size());
    for (int64_t t : raw_types) {
      spec.token_types.push_back(t >= 0 && t <= 6 ? static_cast<TokenType>(t) : TokenType::kUndefined);
    }
  }
  if (const gguf::GgufValue* scores = file.FindValue("tokenizer.ggml.scores")) {
    KVCACHE_ASSIGN_OR_RETURN(auto raw_scores, scores->AsDoubleArray());
    spec.scores.assign(raw_scores.begin(), raw_scores.end());
  }
  if (const gguf::GgufValue* merges = file.FindValue("tokenizer.ggml.merges")) {
    KVCACHE_ASSIGN_OR_RETURN(auto merge_views, merges->AsStringArray());
    for (absl::string_view v : merge_views) spec.merges.emplace_back(v);
  }
  // llama.cpp's defaults per model, before the GGUF keys override them.
  if (spec.model == "llama") {
    spec.bos_id = 1;
    spec.eos_id = 2;
    spec.unk_id = 0;
    spec.add_bos = true;
    spec.add_space_prefix = true;
    for (int32_t* d : {&spec.bos_id, &spec.eos_id, &spec.unk_id}) {
      if (*d >= static_cast<int32_t>(spec.tokens.size())) *d = -1;
    }
  } else if (spec.pre == "llama3" || spec.pre == "llama-v3" || spec.pre == "llama-bpe" ||
             spec.pre == "tekken") {
    spec.add_bos = true;
  }
  auto id = [&](const char* key, int32_t* out) -> absl::Status {
    if (file.FindValue(key) == nullptr) return absl::OkStatus();
    KVCACHE_ASSIGN_OR_RETURN(uint64_t v, file.GetUint64(key));
    if (v < spec.tokens.size()) *out = static_cast<int32_t>(v);  // else: keep the default
    return absl::OkStatus();
  };
  KVCACHE_RETURN_IF_ERROR(id("tokenizer.ggml.bos_token_id", &spec.bos_id));
  KVCACHE_RETURN_IF_ERROR(id("tokenizer.ggml.eos_token_id", &spec.eos_id));
  KVCACHE_RETURN_IF_ERROR(id("tokenizer.ggml.eot_token_id", &spec.eot_id));
  KVCACHE_RETURN_IF_ERROR(id("tokenizer.ggml.unknown_token_id", &spec.unk_id));
  KVCACHE_RETURN_IF_ERROR(id("tokenizer.ggml.padding_token_id", &spec.pad_id));
  if (file.FindValue("tokenizer.ggml.add_bos_token") != nullptr) {
    KVCACHE_ASSIGN_OR_RETURN(spec.add_bos, file.GetBool("tokenizer.ggml.add_bos_token"));
  }
  if (file.FindValue("tokenizer.ggml.add_eos_token") != nullptr) {
    KVCACHE_ASSIGN_OR_RETURN(spec.add_eos, file.GetBool("tokenizer.ggml.add_eos_token"));
  }
  if (file.FindValue("tokenizer.ggml.add_space_prefix") != nullptr) {
    KVCACHE_ASSIGN_OR_RETURN(spec.add_space_prefix, file.GetBool("tokenizer.ggml.add_space_prefix"));
  }
  return Create(std::move(spec));
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::Create(VocabSpec spec) {
  std::unique_ptr<Tokenizer> t(new Tokenizer());
  KVCACHE_RETURN_IF_ERROR(t->Init(std::move(spec)));
  return t;
}

int32_t Tokenizer::InternSymbol(const std::string& text) {
  auto [it, inserted] = symbol_ids_.emplace(text, static_cast<int32_t>(symbol_text_.size()));
  if (inserted) symbol_text_.push_back(text);
  return it->second;
}

absl::Status Tokenizer::Init(VocabSpec spec) {
  if (spec.model != "gpt2" && spec.model != "llama") {
    return absl::UnimplementedError(absl::StrCat("tokenizer model '", spec.model,
                                                 "' is not supported (supported: gpt2 byte-level BPE, "
                                                 "llama SentencePiece)"));
  }
  spm_ = spec.model == "llama";
  if (spm_) {
    // SentencePiece has no pre-tokenizer; tokenizer.ggml.pre is ignored.
  } else if (spec.pre == "llama3" || spec.pre == "llama-v3" || spec.pre == "llama-bpe") {
    pre_ = PreKind::kLlama3;
    ignore_merges_ = true;
  } else if (spec.pre == "tekken") {
    pre_ = PreKind::kTekken;
    ignore_merges_ = true;
  } else if (spec.pre == "qwen2" || spec.pre == "deepseek-r1-qwen" || spec.pre == "megrez" ||
             spec.pre == "stablelm2") {
    pre_ = PreKind::kQwen2;
  } else if (spec.pre == "smollm" || spec.pre == "starcoder" || spec.pre == "refact" ||
             spec.pre == "command-r" || spec.pre == "codeshell" || spec.pre == "exaone" ||
             spec.pre == "minerva-7b") {
    pre_ = PreKind::kSmollm;
  } else if (spec.pre == "gpt-2" || spec.pre == "gpt2" || spec.pre == "mpt" || spec.pre == "olmo" ||
             spec.pre == "jais") {
    pre_ = PreKind::kGpt2;
  } else {
    return absl::UnimplementedError(
        absl::StrCat("pre-tokenizer '", spec.pre,
                     "' is not supported (supported: llama-bpe, llama3, tekken, qwen2, deepseek-r1-qwen, "
                     "smollm, starcoder, refact, command-r, codeshell, exaone, minerva-7b, gpt-2, mpt, "
                     "olmo, jais)"));
  }
  if (spec.tokens.empty() || spec.tokens.size() > (1u << 24)) {
    return absl::InvalidArgumentError(
        absl::StrCat("vocabulary size ", spec.tokens.size(), " is not in [1, 2^24]"));
  }
  if (!spec.token_types.empty() && spec.token_types.size() != spec.tokens.size()) {
    return absl::InvalidArgumentError(absl::StrCat("token_type has ", spec.token_types.size(),
                                                   " entries for ", spec.tokens.size(), " tokens"));
  }
  const int32_t n = static_cast<int32_t>(spec.tokens.size());
  for (int32_t* id : {&spec.bos_id, &spec.eos_id, &spec.eot_id, &spec.unk_id, &spec.pad_id}) {
    if (*id < -1 || *id >= n) {
      return absl::InvalidArgumentError(
          absl::StrCat("special token id ", *id, " is outside the vocabulary of ", n));
    }
  }
  if (!spec.scores.empty() && spec.scores.size() != spec.tokens.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("scores has ", spec.scores.size(), " entries for ", spec.tokens.size(), " tokens"));
  }
  if (spm_ && !spec.merges.empty()) {
    return absl::InvalidArgumentError("a SentencePiece vocabulary carries no merges");
  }
  tokens_ = spec.tokens;
  types_ = spec.token_types;
  if (types_.empty()) types_.assign(tokens_.size(), TokenType::kNormal);
  scores_ = spec.scores;
  if (scores_.empty()) scores_.assign(tokens_.size(), 0.0f);
  for (int32_t i = 0; i < n; ++i) {
    if (IsForcedControlText(tokens_[i])) types_[i] = TokenType::kControl;
  }

  // Token ids are the first symbol ids. On duplicate texts the first id wins.
  symbol_text_ = tokens_;
  symbol_ids_.reserve(tokens_.size() + spec.merges.size());
  for (int32_t i = 0; i < n; ++i) symbol_ids_.emplace(tokens_[i], i);
  merges_.reserve(spec.merges.size());
  for (size_t r = 0; r < spec.merges.size(); ++r) {
    const std::string& m = spec.merges[r];
    const size_t sp = m.find(' ', 1);
    if (sp == std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat("merge ", r, " '", m, "' is not 'left right'"));
    }
    const std::string left = m.substr(0, sp), right = m.substr(sp + 1);
    const int32_t l = InternSymbol(left);
    const int32_t rt = InternSymbol(right);
    const int32_t res = InternSymbol(left + right);
    const uint64_t key = (static_cast<uint64_t>(l) << 32) | static_cast<uint32_t>(rt);
    merges_.emplace(key, Merge{static_cast<int32_t>(r), res});  // first rank wins
  }
  for (int b = 0; b < 256; ++b) {
    std::string s;
    AppendUtf8(ByteToCodepoint(static_cast<uint8_t>(b)), &s);
    auto it = symbol_ids_.find(s);
    byte_symbol_[b] = it == symbol_ids_.end() ? -1 : it->second;
  }

  for (int32_t i = 0; i < n; ++i) {
    if (IsSpecialType(types_[i]) && !tokens_[i].empty()) special_ids_.push_back(i);
  }
  std::stable_sort(special_ids_.begin(), special_ids_.end(),
                   [&](int32_t a, int32_t b) { return tokens_[a].size() > tokens_[b].size(); });

  eog_.assign(tokens_.size(), false);
  for (int32_t id : {spec.eos_id, spec.eot_id}) {
    if (id >= 0) eog_[id] = true;
  }
  for (int32_t i = 0; i < n; ++i) {
    if (IsEogText(tokens_[i])) eog_[i] = true;
  }
  eog_ids_.clear();
  for (int32_t i = 0; i < n; ++i) {
    if (eog_[i]) eog_ids_.push_back(i);
  }
  spec_ = std::move(spec);
  return absl::OkStatus();
}

int32_t Tokenizer::FindToken(absl::string_view text) const {
  auto it = symbol_ids_.find(text);
  return it == symbol_ids_.end() || it->second >= n_vocab() ? -1 : it->second;
}

bool Tokenizer::IsEndOfGeneration(int32_t id) const { return IsValid(id) && eog_[id]; }

std::vector<int32_t> Tokenizer::Encode(absl::string_view text, const EncodeOptions& options) const {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 4);
  if (options.add_special && spec_.add_bos && spec_.bos_id >= 0) out.push_back(spec_.bos_id);

  // Partition on special tokens, longest first: fragments are either a token
  // id or a range of raw text.
  struct Fragment {
    int32_t id;  // -1: raw text [begin, end)
    size_t begin, end;
  };
  std::vector<Fragment> frags;
  if (!text.empty()) frags.push_back({-1, 0, text.size()});
  // Control tokens may not overlap a plain span. Only matches are tested
  // against the spans: the fragments of raw text stay those of the whole text.
  const std::vector<std::pair<size_t, size_t>> plain =
      options.parse_special ? MergeSpans(options.plain_spans) : std::vector<std::pair<size_t, size_t>>();
  std::vector<Fragment> next;
  for (int32_t id : special_ids_) {
    const TokenType t = types_[id];
    const bool control = t == TokenType::kControl || t == TokenType::kUnknown;
    if (!options.parse_special && control) continue;
    const std::string& s = tokens_[id];
    if (text.find(s) == absl::string_view::npos) continue;
    const bool restricted = control && !plain.empty();
    next.clear();
    for (const Fragment& f : frags) {
      if (f.id >= 0) {
        next.push_back(f);
        continue;
      }
      size_t cur = f.begin;   // start of the raw text not yet emitted
      size_t from = f.begin;  // where the next search starts
      while (from < f.end) {
        const size_t hit = text.substr(0, f.end).find(s, from);
        if (hit == absl::string_view::npos) break;
        if (restricted && OverlapsAny(plain, hit, hit + s.size())) {
          from = hit + 1;  // a later match may start inside this one
          continue;
        }
        if (hit > cur) next.push_back({-1, cur, hit});
        next.push_back({id, hit, hit + s.size()});
        cur = from = hit + s.size();
      }
      if (cur < f.end) next.push_back({-1, cur, f.end});
    }
    frags.swap(next);
  }
  // SentencePiece: a space goes before the text at the start and after every
  // special token; spaces are then written as U+2581 ("\xe2\x96\x81").
  bool prev_special = true;
  std::string escaped;
  for (const Fragment& f : frags) {
    if (f.id >= 0) {
      out.push_back(f.id);
      prev_special = true;
      continue;
    }
    const absl::string_view raw = text.substr(f.begin, f.end - f.begin);
    if (!spm_) {
      EncodeFragment(raw, &out);
      continue;
    }
    escaped.clear();
    if (spec_.add_space_prefix && prev_special) escaped = "\xe2\x96\x81";
    for (char c : raw) {
      if (c == ' ') {
        escaped += "\xe2\x96\x81";
      } else {
        escaped.push_back(c);
      }
    }
    EncodeSpm(escaped, &out);
    prev_special = false;
  }
  if (options.add_special && spec_.add_eos && spec_.eos_id >= 0) out.push_back(spec_.eos_id);
  return out;
}

void Tokenizer::EncodeFragment(absl::string_view text, std::vector<int32_t>* out) const {
  if (text.empty()) return;
  const std::vector<uint32_t> cps = DecodeUtf8All(text);
  std::vector<uint8_t> flags(cps.size());
  for (size_t i = 0; i < cps.size(); ++i) flags[i] = CodepointFlags(cps[i]);
  std::string word;
  auto emit = [&](size_t b, size_t e) {
    word.clear();
    for (size_t i = b; i < e; ++i) AppendUtf8(cps[i], &word);
    EncodeWord(word, out);
  };
  if (pre_ == PreKind::kGpt2) {
    SplitGpt2(cps.data(), flags.data(), 0, cps.size(), emit);
    return;
  }
  if (pre_ == PreKind::kLlama3 || pre_ == PreKind::kQwen2 || pre_ == PreKind::kTekken) {
    const SplitRules& rules = pre_ == PreKind::kLlama3  ? kLlama3Rules
                              : pre_ == PreKind::kQwen2 ? kQwen2Rules
                                                        : kTekkenRules;
    SplitLlama3(cps.data(), flags.data(), 0, cps.size(), rules, emit);
    return;
  }
  // smollm: first `\p{N}` isolates every number code point, then GPT-2 runs
  // on each piece separately.
  size_t start = 0;
  for (size_t i = 0; i < cps.size(); ++i) {
    if (flags[i] & kNumber) {
      if (i > start) SplitGpt2(cps.data(), flags.data(), start, i, emit);
      SplitGpt2(cps.data(), flags.data(), i, i + 1, emit);
      start = i + 1;
    }
  }
  if (start < cps.size()) SplitGpt2(cps.data(), flags.data(), start, cps.size(), emit);
}

void Tokenizer::EncodeWord(absl::string_view word, std::vector<int32_t>* out) const {
  struct Symbol {
    int32_t sym;  // symbol id; < -1 encodes a raw byte without a symbol: -(b + 2)
    int32_t prev, next;
  };
  const int32_t n = static_cast<int32_t>(word.size());
  if (ignore_merges_ && n > 1) {
    std::string encoded;
    for (char c : word) AppendUtf8(ByteToCodepoint(static_cast<uint8_t>(c)), &encoded);
    const int32_t whole = FindToken(encoded);
    if (whole >= 0) {
      out->push_back(whole);
      return;
    }
  }
  std::vector<Symbol> symbols(n);
  for (int32_t i = 0; i < n; ++i) {
    const uint8_t b = static_cast<uint8_t>(word[i]);
    symbols[i] = {byte_symbol_[b] >= 0 ? byte_symbol_[b] : -(b + 2), i - 1, i + 1 < n ? i + 1 : -1};
  }
  std::priority_queue<Bigram> queue;
  auto add_bigram = [&](int32_t left, int32_t right) {
    if (left < 0 || right < 0) return;
    const int32_t ls = symbols[left].sym, rs = symbols[right].sym;
    if (ls < 0 || rs < 0) return;
    auto it = merges_.find((static_cast<uint64_t>(ls) << 32) | static_cast<uint32_t>(rs));
    if (it == merges_.end()) return;
    queue.push({it->second.rank, left, right, ls, rs});
  };
  for (int32_t i = 1; i < n; ++i) add_bigram(i - 1, i);
  while (!queue.empty()) {
    const Bigram bg = queue.top();
    queue.pop();
    Symbol& l = symbols[bg.left];
    Symbol& r = symbols[bg.right];
    // Stale entry: one side was merged away or grew since it was queued.
    if (l.sym != bg.left_sym || r.sym != bg.right_sym || l.next != bg.right) continue;
    const uint64_t key = (static_cast<uint64_t>(bg.left_sym) << 32) | static_cast<uint32_t>(bg.right_sym);
    l.sym = merges_.find(key)->second.result;
    l.next = r.next;
    if (r.next >= 0) symbols[r.next].prev = bg.left;
    r.sym = -1;  // dead
    r.next = -1;
    add_bigram(l.prev, bg.left);
    add_bigram(bg.left, l.next);
  }
  for (int32_t i = 0; i >= 0 && i < n; i = symbols[i].next) {
    const int32_t s = symbols[i].sym;
    if (s >= 0 && s < n_vocab()) {
      out->push_back(s);
      continue;
    }
    // Not a token: llama.cpp falls back to the single bytes of the symbol's
    // (byte-encoded) text that happen to be tokens.
    std::string text;
    if (s >= 0) {
      text = symbol_text_[s];
    } else {
      AppendUtf8(ByteToCodepoint(static_cast<uint8_t>(-s - 2)), &text);
    }
    for (char c : text) {
      const int32_t id = FindToken(absl::string_view(&c, 1));
      if (id >= 0) out->push_back(id);
    }
  }
}

int32_t Tokenizer::SpmByteToken(uint8_t b) const {
  static constexpr char kHex[] = "0123456789ABCDEF";
  const char name[6] = {'<', '0', 'x', kHex[b >> 4], kHex[b & 15], '>'};
  const int32_t id = FindToken(absl::string_view(name, 6));
  if (id >= 0) return id;
  const char raw = static_cast<char>(b);
  return FindToken(absl::string_view(&raw, 1));
}

void Tokenizer::EncodeSpm(absl::string_view text, std::vector<int32_t>* out) const {
  // Symbols start as single characters; the pair whose concatenation is the
  // highest-scoring token merges first (ties: leftmost), as in llama.cpp.
  struct Symbol {
    size_t begin, len;  // bytes of text; len 0: merged away
    int32_t prev, next;
  };
  struct Pair {
    float score;
    int32_t left, right;
    size_t len;                            // bytes of the merged text when queued
    bool operator<(const Pair& o) const {  // priority_queue pops the largest
      return score != o.score ? score < o.score : left > o.left;
    }
  };
  std::vector<Symbol> symbols;
  for (size_t off = 0; off < text.size();) {
    const size_t len = std::min(CharLength(static_cast<uint8_t>(text[off])), text.size() - off);
    const int32_t idx = static_cast<int32_t>(symbols.size());
    symbols.push_back({off, len, idx - 1, off + len == text.size() ? -1 : idx + 1});
    off += len;
  }
  if (symbols.empty()) return;
  std::priority_queue<Pair> queue;
  auto try_pair = [&](int32_t left, int32_t right) {
    if (left < 0 || right < 0) return;
    const size_t len = symbols[left].len + symbols[right].len;
    const int32_t id = FindToken(text.substr(symbols[left].begin, len));
    if (id < 0) return;
    queue.push({scores_[id], left, right, len});
  };
  for (int32_t i = 1; i < static_cast<int32_t>(symbols.size()); ++i) try_pair(i - 1, i);
  while (!queue.empty()) {
    const Pair p = queue.top();
    queue.pop();
    Symbol& l = symbols[p.left];
    Symbol& r = symbols[p.right];
    // Stale entry: one side was merged away or grew since it was queued.
    if (l.len == 0 || r.len == 0 || l.len + r.len != p.len) continue;
    l.len += r.len;
    r.len = 0;
    l.next = r.next;
    if (r.next >= 0) symbols[r.next].prev = p.left;
    try_pair(l.prev, p.left);
    try_pair(p.left, l.next);
  }
  for (int32_t i = 0; i >= 0; i = symbols[i].next) {
    const absl::string_view piece = text.substr(symbols[i].begin, symbols[i].len);
    const int32_t id = FindToken(piece);
    if (id >= 0) {
      out->push_back(id);
      continue;
    }
    // Byte fallback: merged symbols are always tokens, so this is one
    // character that is not a token; it is spelled as its bytes.
    for (char c : piece) {
      const int32_t b = SpmByteToken(static_cast<uint8_t>(c));
      if (b >= 0) {
        out->push_back(b);
      } else if (spec_.unk_id >= 0) {
        out->push_back(spec_.unk_id);
      }
    }
  }
}

absl::StatusOr<std::string> Tokenizer::TokenToPiece(int32_t id, bool special) const {
  if (!IsValid(id)) {
    return absl::OutOfRangeError(absl::StrCat("token id ", id, " is outside the vocabulary of ", n_vocab()));
  }
  const TokenType t = types_[id];
  const std::string& text = tokens_[id];
  if (t == TokenType::kControl || t == TokenType::kUnknown) return special ? text : "";
  if (t == TokenType::kUserDefined) return text;
  if (t == TokenType::kByte) {
    // "<0xNN>"
    int value = 0;
    if (text.size() == 6 && absl::SimpleHexAtoi(absl::string_view(text).substr(3, 2), &value)) {
      return std::string(1, static_cast<char>(value));
    }
    return std::string();
  }
  if (t != TokenType::kNormal) return std::string();
  if (spm_) return absl::StrReplaceAll(text, {{"\xe2\x96\x81", " "}});
  std::string out;
  out.reserve(text.size());
  size_t pos = 0;
  while (pos < text.size()) {
    const uint32_t cp = DecodeUtf8(text, &pos);
    const int b = CodepointToByte(cp);
    if (b >= 0) {
      out.push_back(static_cast<char>(b));
      continue;
    }
    // Same marker llama.cpp emits for a code point outside the byte map.
    std::string utf8;
    AppendUtf8(cp, &utf8);
    absl::StrAppend(&out, "[UNK_BYTE_0x");
    for (char c : utf8) absl::StrAppendFormat(&out, "%02x", static_cast<uint8_t>(c));
    absl::StrAppend(&out, text, "]");
  }
  return out;
}

absl::StatusOr<std::string> Tokenizer::Decode(absl::Span<const int32_t> ids, bool special) const {
  std::string out;
  for (int32_t id : ids) {
    KVCACHE_ASSIGN_OR_RETURN(std::string piece, TokenToPiece(id, special));
    out += piece;
  }
  return out;
}

}  // namespace tok
}  // namespace kvcache
