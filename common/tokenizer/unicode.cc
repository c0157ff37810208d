#include "common/tokenizer/unicode.h"

#include <algorithm>
#include <array>

namespace kvcache {
namespace tok {
namespace {

struct CpRange {
  uint32_t first;
  uint32_t last;
  uint8_t flags;
};

constexpr CpRange kRanges[] = {
#include "common/tokenizer/unicode_tables.inc"
};

// Unicode White_Space (the set llama.cpp's `\s` uses).
bool IsWhitespace(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
         cp == 0x3000;
}

uint8_t LookupFlags(uint32_t cp) {
  uint8_t f = IsWhitespace(cp) ? kWhitespace : 0;
  const CpRange* end = kRanges + sizeof(kRanges) / sizeof(kRanges[0]);
  const CpRange* it =
      std::upper_bound(kRanges, end, cp, [](uint32_t c, const CpRange& r) { return c < r.first; });
  if (it != kRanges && cp <= (it - 1)->last) f |= (it - 1)->flags;
  return f;
}

struct ByteTables {
  std::array<uint32_t, 256> to_cp;
  std::array<int16_t, 324> from_cp;  // every image is < 256 + 68
};

ByteTables MakeByteTables() {
  ByteTables t;
  t.from_cp.fill(-1);
  auto printable = [](int b) {
    return (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
  };
  int n = 0;
  for (int b = 0; b < 256; ++b) {
    t.to_cp[b] = printable(b) ? static_cast<uint32_t>(b) : static_cast<uint32_t>(256 + n++);
    t.from_cp[t.to_cp[b]] = static_cast<int16_t>(b);
  }
  return t;
}

const ByteTables& Tables() {
  static const ByteTables* t = new ByteTables(MakeByteTables());
  return *t;
}

struct FlagCache {
  std::array<uint8_t, 0x10000> bmp;  // flags for the Basic Multilingual Plane
  FlagCache() {
    for (uint32_t cp = 0; cp < bmp.size(); ++cp) bmp[cp] = LookupFlags(cp);
  }
};

}  // namespace

uint32_t DecodeUtf8(absl::string_view s, size_t* pos) {
  const size_t i = *pos;
  const auto b = [&](size_t k) { return static_cast<uint8_t>(s[k]); };
  const uint8_t c = b(i);
  const auto cont = [&](size_t k) { return k < s.size() && (b(k) & 0xC0) == 0x80; };
  if (c < 0x80) {
    *pos = i + 1;
    return c;
  }
  if ((c & 0xE0) == 0xC0 && cont(i + 1)) {
    *pos = i + 2;
    return (static_cast<uint32_t>(c & 0x1F) << 6) | (b(i + 1) & 0x3F);
  }
  if ((c & 0xF0) == 0xE0 && cont(i + 1) && cont(i + 2)) {
    *pos = i + 3;
    return (static_cast<uint32_t>(c & 0x0F) << 12) | (static_cast<uint32_t>(b(i + 1) & 0x3F) << 6) |
           (b(i + 2) & 0x3F);
  }
  if ((c & 0xF8) == 0xF0 && cont(i + 1) && cont(i + 2) && cont(i + 3)) {
    *pos = i + 4;
    return (static_cast<uint32_t>(c & 0x07) << 18) | (static_cast<uint32_t>(b(i + 1) & 0x3F) << 12) |
           (static_cast<uint32_t>(b(i + 2) & 0x3F) << 6) | (b(i + 3) & 0x3F);
  }
  *pos = i + 1;
  return kReplacementChar;
}

std::vector<uint32_t> DecodeUtf8All(absl::string_view s) {
  std::vector<uint32_t> out;
  out.reserve(s.size());
  size_t pos = 0;
  while (pos < s.size()) out.push_back(DecodeUtf8(s, &pos));
  return out;
}

void AppendUtf8(uint32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | ((cp >> 18) & 0x07)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

int Utf8SequenceLength(uint8_t lead) {
  if (lead < 0x80) return 1;
  if ((lead & 0xE0) == 0xC0) return 2;
  if ((lead & 0xF0) == 0xE0) return 3;
  if ((lead & 0xF8) == 0xF0) return 4;
  return 0;
}

uint8_t CodepointFlags(uint32_t cp) {
  static const FlagCache* cache = new FlagCache();
  return cp < 0x10000 ? cache->bmp[cp] : LookupFlags(cp);
}

uint32_t ByteToCodepoint(uint8_t b) { return Tables().to_cp[b]; }

int CodepointToByte(uint32_t cp) { return cp < Tables().from_cp.size() ? Tables().from_cp[cp] : -1; }

}  // namespace tok
}  // namespace kvcache
