#include "common/tokenizer/streaming_detokenizer.h"

#include "common/tokenizer/unicode.h"

namespace kvcache {
namespace tok {
namespace {

// Length of the well-formed UTF-8 sequence at s[i] (1..4); 0 when ill-formed;
// -1 when the bytes so far are a valid prefix cut off by the end of s.
int WellFormedLength(absl::string_view s, size_t i) {
  const auto at = [&](size_t k) { return static_cast<uint8_t>(s[k]); };
  const uint8_t c = at(i);
  if (c < 0x80) return 1;
  int len;
  uint8_t lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (c >= 0xC2 && c <= 0xDF) {
    len = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    len = 3;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;  // no surrogates
  } else if (c >= 0xF0 && c <= 0xF4) {
    len = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    return 0;
  }
  for (int k = 1; k < len; ++k) {
    if (i + k >= s.size()) return -1;
    const uint8_t b = at(i + k);
    if (k == 1 ? (b < lo || b > hi) : (b & 0xC0) != 0x80) return 0;
  }
  return len;
}

}  // namespace

std::string SanitizeUtf8(absl::string_view bytes, bool keep_tail, std::string* tail) {
  std::string out;
  out.reserve(bytes.size());
  size_t i = 0;
  while (i < bytes.size()) {
    const int len = WellFormedLength(bytes, i);
    if (len > 0) {
      out.append(bytes.data() + i, len);
      i += len;
    } else if (len < 0 && keep_tail) {
      if (tail != nullptr) tail->assign(bytes.data() + i, bytes.size() - i);
      return out;
    } else {
      AppendUtf8(kReplacementChar, &out);
      ++i;
      // Skip the continuation bytes of the same broken sequence.
      while (i < bytes.size() && (static_cast<uint8_t>(bytes[i]) & 0xC0) == 0x80 && len < 0) {
        ++i;
      }
    }
  }
  if (tail != nullptr) tail->clear();
  return out;
}

absl::StatusOr<std::string> StreamingDetokenizer::Add(int32_t id) {
  absl::StatusOr<std::string> piece = tokenizer_->TokenToPiece(id, special_);
  if (!piece.ok()) return piece.status();
  return AddBytes(*piece);
}

std::string StreamingDetokenizer::AddBytes(absl::string_view bytes) {
  pending_.append(bytes.data(), bytes.size());
  std::string tail;
  std::string out = SanitizeUtf8(pending_, /*keep_tail=*/true, &tail);
  pending_.swap(tail);
  return out;
}

std::string StreamingDetokenizer::Finish() {
  std::string out = SanitizeUtf8(pending_, /*keep_tail=*/false, nullptr);
  pending_.clear();
  return out;
}

}  // namespace tok
}  // namespace kvcache
