#include "common/gguf/ggml_types.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/gguf/fp16.h"

namespace kvcache {
namespace gguf {
namespace {

struct TraitsEntry {
  uint32_t raw;
  GgmlTypeTraits traits;
};

// Sizes of every type ggml knows, so that files holding types we cannot decode
// still open (the error comes when such a tensor is dequantised).
constexpr TraitsEntry kTraits[] = {
    {0, {"f32", 1, 4, true}},          {1, {"f16", 1, 2, true}},          {2, {"q4_0", 32, 18, true}},
    {3, {"q4_1", 32, 20, true}},       {6, {"q5_0", 32, 22, true}},       {7, {"q5_1", 32, 24, true}},
    {8, {"q8_0", 32, 34, true}},       {9, {"q8_1", 32, 36, false}},      {10, {"q2_K", 256, 84, false}},
    {11, {"q3_K", 256, 110, false}},   {12, {"q4_K", 256, 144, true}},    {13, {"q5_K", 256, 176, true}},
    {14, {"q6_K", 256, 210, true}},    {15, {"q8_K", 256, 292, false}},   {16, {"iq2_xxs", 256, 66, false}},
    {17, {"iq2_xs", 256, 74, false}},  {18, {"iq3_xxs", 256, 98, false}}, {19, {"iq1_s", 256, 50, false}},
    {20, {"iq4_nl", 32, 18, false}},   {21, {"iq3_s", 256, 110, false}},  {22, {"iq2_s", 256, 82, false}},
    {23, {"iq4_xs", 256, 136, false}}, {24, {"i8", 1, 1, false}},         {25, {"i16", 1, 2, false}},
    {26, {"i32", 1, 4, false}},        {27, {"i64", 1, 8, false}},        {28, {"f64", 1, 8, false}},
    {29, {"iq1_m", 256, 56, false}},   {30, {"bf16", 1, 2, true}},        {34, {"tq1_0", 256, 54, false}},
    {35, {"tq2_0", 256, 66, false}},
};

template <typename Block>
Block LoadBlock(const uint8_t* p) {
  Block b;
  memcpy(&b, p, sizeof(b));
  return b;
}

uint16_t LoadU16(const uint8_t* p) {
  uint16_t v;
  memcpy(&v, p, sizeof(v));
  return v;
}

void StoreU16(uint8_t* p, uint16_t v) { memcpy(p, &v, sizeof(v)); }

// 6-bit scale and min number j (0..7) of a Q4_K/Q5_K super-block.
void ScaleMinK4(int j, const uint8_t* q, uint8_t* d, uint8_t* m) {
  if (j < 4) {
    *d = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *d = static_cast<uint8_t>((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
    *m = static_cast<uint8_t>((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

// Inverse of ScaleMinK4. REQUIRES: sc[j], mn[j] < 64.
void PackScaleMinK4(const uint8_t* sc, const uint8_t* mn, uint8_t* q) {
  memset(q, 0, kKScaleBytes);
  for (int j = 0; j < 8; ++j) {
    if (j < 4) {
      q[j] |= sc[j];
      q[j + 4] |= mn[j];
    } else {
      q[j + 4] = static_cast<uint8_t>((sc[j] & 0xF) | ((mn[j] & 0xF) << 4));
      q[j - 4] |= static_cast<uint8_t>((sc[j] >> 4) << 6);
      q[j] |= static_cast<uint8_t>((mn[j] >> 4) << 6);
    }
  }
}

// ---- Decoders: one block each, y gets block_size floats. ----

void DecodeQ4_0(const uint8_t* p, float* y) {
  const auto b = LoadBlock<BlockQ4_0>(p);
  const float d = Fp16ToFp32(b.d);
  for (int j = 0; j < kQK / 2; ++j) {
    y[j] = static_cast<float>((b.qs[j] & 0x0F) - 8) * d;
    y[j + kQK / 2] = static_cast<float>((b.qs[j] >> 4) - 8) * d;
  }
}

void DecodeQ4_1(const uint8_t* p, float* y) {
  const auto b = LoadBlock<BlockQ4_1>(p);
  const float d = Fp16ToFp32(b.d);
  const float m = Fp16ToFp32(b.m);
  for (int j = 0; j < kQK / 2; ++j) {
    y[j] = static_cast<float>(b.qs[j] & 0x0F) * d + m;
    y[j + kQK / 2] = static_cast<float>(b.qs[j] >> 4) * d + m;
  }
}

void DecodeQ5_0(const uint8_t* p, float* y) {
  const auto b = LoadBlock<BlockQ5_0>(p);
  const float d = Fp16ToFp32(b.d);
  uint32_t qh;
  memcpy(&qh, b.qh, sizeof(qh));
  for (int j = 0; j < kQK / 2; ++j) {
    const int xh0 = static_cast<int>(((qh >> j) << 4) & 0x10);
    const int xh1 = static_cast<int>((qh >> (j + 12)) & 0x10);
    y[j] = static_cast<float>(((b.qs[j] & 0x0F) | xh0) - 16) * d;
    y[j + kQK / 2] = static_cast<float>(((b.qs[j] >> 4) | xh1) - 16) * d;
  }
}

void DecodeQ5_1(const uint8_t* p, float* y) {
  const auto b = LoadBlock<BlockQ5_1>(p);
  const float d = Fp16ToFp32(b.d);
  const float m = Fp16ToFp32(b.m);
  uint32_t qh;
  memcpy(&qh, b.qh, sizeof(qh));
  for (int j = 0; j < kQK / 2; ++j) {
    const int xh0 = static_cast<int>(((qh >> j) << 4) & 0x10);
    const int xh1 = static_cast<int>((qh >> (j + 12)) & 0x10);
    y[j] = static_cast<float>((b.qs[j] & 0x0F) | xh0) * d + m;
    y[j + kQK / 2] = static_cast<float>((b.qs[j] >> 4) | xh1) * d + m;
  }
}

void DecodeQ8_0(const uint8_t* p, float* y) {
  const auto b = LoadBlock<BlockQ8_0>(p);
  const float d = Fp16ToFp32(b.d);
  for (int j = 0; j < kQK; ++j) y[j] = static_cast<float>(b.qs[j]) * d;
}

void DecodeQ4_K(const uint8_t* p, float* y) {
  const auto b = LoadBlock<BlockQ4_K>(p);
  const float d = Fp16ToFp32(b.d);
  const float dmin = Fp16ToFp32(b.dmin);
  const uint8_t* q = b.qs;
  int is = 0;
  for (int j = 0; j < kQKK; j += 64) {
    uint8_t sc, m;
    ScaleMinK4(is + 0, b.scales, &sc, &m);
    const float d1 = d * sc, m1 = dmin * m;
    ScaleMinK4(is + 1, b.scales, &sc, &m);
    const float d2 = d * sc, m2 = dmin * m;
    for (int l = 0; l < 32; ++l) *y++ = d1 * static_cast<float>(q[l] & 0xF) - m1;
    for (int l = 0; l < 32; ++l) *y++ = d2 * static_cast<float>(q[l] >> 4) - m2;
    q += 32;
    is += 2;
  }
}

void DecodeQ5_K(const uint8_t* p, float* y) {
  const auto b = LoadBlock<BlockQ5_K>(p);
  const float d = Fp16ToFp32(b.d);
  const float dmin = Fp16ToFp32(b.dmin);
  const uint8_t* ql = b.qs;
  int is = 0;
  unsigned u1 = 1, u2 = 2;
  for (int j = 0; j < kQKK; j += 64) {
    uint8_t sc, m;
    ScaleMinK4(is + 0, b.scales, &sc, &m);
    const float d1 = d * sc, m1 = dmin * m;
    ScaleMinK4(is + 1, b.scales, &sc, &m);
    const float d2 = d * sc, m2 = dmin * m;
    for (int l = 0; l < 32; ++l) {
      *y++ = d1 * static_cast<float>((ql[l] & 0xF) + (b.qh[l] & u1 ? 16 : 0)) - m1;
    }
    for (int l = 0; l < 32; ++l) {
      *y++ = d2 * static_cast<float>((ql[l] >> 4) + (b.qh[l] & u2 ? 16 : 0)) - m2;
    }
    ql += 32;
    is += 2;
    u1 <<= 2;
    u2 <<= 2;
  }
}

void DecodeQ6_K(const uint8_t* p, float* y) {
  const auto b = LoadBlock<BlockQ6_K>(p);
  const float d = Fp16ToFp32(b.d);
  const uint8_t* ql = b.ql;
  const uint8_t* qh = b.qh;
  const int8_t* sc = b.scales;
  for (int n = 0; n < kQKK; n += 128) {
    for (int l = 0; l < 32; ++l) {
      const int is = l / 16;
      const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
      const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
      const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
      const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
      y[l] = d * sc[is + 0] * static_cast<float>(q1);
      y[l + 32] = d * sc[is + 2] * static_cast<float>(q2);
      y[l + 64] = d * sc[is + 4] * static_cast<float>(q3);
      y[l + 96] = d * sc[is + 6] * static_cast<float>(q4);
    }
    y += 128;
    ql += 64;
    qh += 32;
    sc += 8;
  }
}

// ---- Quantisers (round to nearest; ggml's reference rules for the 32-blocks). ----

void QuantizeQ4_0(const float* x, uint8_t* p) {
  float amax = 0.0f, max = 0.0f;
  for (int j = 0; j < kQK; ++j) {
    if (std::fabs(x[j]) > amax) {
      amax = std::fabs(x[j]);
      max = x[j];
    }
  }
  const float d = max / -8.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  BlockQ4_0 b;
  b.d = Fp32ToFp16(d);
  for (int j = 0; j < kQK / 2; ++j) {
    const int q0 = std::min(15, static_cast<int>(x[j] * id + 8.5f));
    const int q1 = std::min(15, static_cast<int>(x[j + kQK / 2] * id + 8.5f));
    b.qs[j] = static_cast<uint8_t>(q0 | (q1 << 4));
  }
  memcpy(p, &b, sizeof(b));
}

void QuantizeQ4_1(const float* x, uint8_t* p) {
  float mn = x[0], mx = x[0];
  for (int j = 1; j < kQK; ++j) {
    mn = std::min(mn, x[j]);
    mx = std::max(mx, x[j]);
  }
  const float d = (mx - mn) / 15.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  BlockQ4_1 b;
  b.d = Fp32ToFp16(d);
  b.m = Fp32ToFp16(mn);
  for (int j = 0; j < kQK / 2; ++j) {
    const int q0 = std::min(15, static_cast<int>((x[j] - mn) * id + 0.5f));
    const int q1 = std::min(15, static_cast<int>((x[j + kQK / 2] - mn) * id + 0.5f));
    b.qs[j] = static_cast<uint8_t>(q0 | (q1 << 4));
  }
  memcpy(p, &b, sizeof(b));
}

void QuantizeQ5_0(const float* x, uint8_t* p) {
  float amax = 0.0f, max = 0.0f;
  for (int j = 0; j < kQK; ++j) {
    if (std::fabs(x[j]) > amax) {
      amax = std::fabs(x[j]);
      max = x[j];
    }
  }
  const float d = max / -16.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  BlockQ5_0 b;
  b.d = Fp32ToFp16(d);
  uint32_t qh = 0;
  for (int j = 0; j < kQK / 2; ++j) {
    const int q0 = std::min(31, static_cast<int>(x[j] * id + 16.5f));
    const int q1 = std::min(31, static_cast<int>(x[j + kQK / 2] * id + 16.5f));
    b.qs[j] = static_cast<uint8_t>((q0 & 0xF) | ((q1 & 0xF) << 4));
    qh |= static_cast<uint32_t>((q0 & 0x10) >> 4) << j;
    qh |= static_cast<uint32_t>((q1 & 0x10) >> 4) << (j + kQK / 2);
  }
  memcpy(b.qh, &qh, sizeof(qh));
  memcpy(p, &b, sizeof(b));
}

void QuantizeQ5_1(const float* x, uint8_t* p) {
  float mn = x[0], mx = x[0];
  for (int j = 1; j < kQK; ++j) {
    mn = std::min(mn, x[j]);
    mx = std::max(mx, x[j]);
  }
  const float d = (mx - mn) / 31.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  BlockQ5_1 b;
  b.d = Fp32ToFp16(d);
  b.m = Fp32ToFp16(mn);
  uint32_t qh = 0;
  for (int j = 0; j < kQK / 2; ++j) {
    const int q0 = std::min(31, static_cast<int>((x[j] - mn) * id + 0.5f));
    const int q1 = std::min(31, static_cast<int>((x[j + kQK / 2] - mn) * id + 0.5f));
    b.qs[j] = static_cast<uint8_t>((q0 & 0xF) | ((q1 & 0xF) << 4));
    qh |= static_cast<uint32_t>((q0 & 0x10) >> 4) << j;
    qh |= static_cast<uint32_t>((q1 & 0x10) >> 4) << (j + kQK / 2);
  }
  memcpy(b.qh, &qh, sizeof(qh));
  memcpy(p, &b, sizeof(b));
}

void QuantizeQ8_0(const float* x, uint8_t* p) {
  float amax = 0.0f;
  for (int j = 0; j < kQK; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float d = amax / 127.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  BlockQ8_0 b;
  b.d = Fp32ToFp16(d);
  for (int j = 0; j < kQK; ++j) b.qs[j] = static_cast<int8_t>(std::lround(x[j] * id));
  memcpy(p, &b, sizeof(b));
}

int ClampRound(float v, int lo, int hi) {
  const long r = std::lround(v);
  return static_cast<int>(std::min<long>(hi, std::max<long>(lo, r)));
}

// Q4_K / Q5_K: x ~= d*sc*q - dmin*m per 32-element sub-block, q in [0, levels].
void QuantizeKMinScale(const float* x, int levels, float* d_out, float* dmin_out, uint8_t* sc, uint8_t* mn,
                       uint8_t* q) {
  float sub_scale[8], sub_min[8];
  float max_scale = 0.0f, max_min = 0.0f;
  for (int s = 0; s < 8; ++s) {
    float lo = 0.0f, hi = 0.0f;  // include 0 so that mins stay >= 0
    for (int l = 0; l < 32; ++l) {
      lo = std::min(lo, x[s * 32 + l]);
      hi = std::max(hi, x[s * 32 + l]);
    }
    sub_scale[s] = (hi - lo) / static_cast<float>(levels);
    sub_min[s] = -lo;
    max_scale = std::max(max_scale, sub_scale[s]);
    max_min = std::max(max_min, sub_min[s]);
  }
  const float d = Fp16ToFp32(Fp32ToFp16(max_scale / 63.0f));
  const float dmin = Fp16ToFp32(Fp32ToFp16(max_min / 63.0f));
  *d_out = d;
  *dmin_out = dmin;
  for (int s = 0; s < 8; ++s) {
    sc[s] = static_cast<uint8_t>(d > 0 ? ClampRound(sub_scale[s] / d, 0, 63) : 0);
    mn[s] = static_cast<uint8_t>(dmin > 0 ? ClampRound(sub_min[s] / dmin, 0, 63) : 0);
    const float ds = d * sc[s];
    const float ms = dmin * mn[s];
    for (int l = 0; l < 32; ++l) {
      q[s * 32 + l] = static_cast<uint8_t>(ds > 0 ? ClampRound((x[s * 32 + l] + ms) / ds, 0, levels) : 0);
    }
  }
}

void QuantizeQ4_K(const float* x, uint8_t* p) {
  float d, dmin;
  uint8_t sc[8], mn[8], q[kQKK];
  QuantizeKMinScale(x, 15, &d, &dmin, sc, mn, q);
  BlockQ4_K b;
  b.d = Fp32ToFp16(d);
  b.dmin = Fp32ToFp16(dmin);
  PackScaleMinK4(sc, mn, b.scales);
  for (int j = 0; j < 4; ++j) {
    for (int l = 0; l < 32; ++l) {
      b.qs[j * 32 + l] = static_cast<uint8_t>(q[j * 64 + l] | (q[j * 64 + 32 + l] << 4));
    }
  }
  memcpy(p, &b, sizeof(b));
}

void QuantizeQ5_K(const float* x, uint8_t* p) {
  float d, dmin;
  uint8_t sc[8], mn[8], q[kQKK];
  QuantizeKMinScale(x, 31, &d, &dmin, sc, mn, q);
  BlockQ5_K b;
  b.d = Fp32ToFp16(d);
  b.dmin = Fp32ToFp16(dmin);
  PackScaleMinK4(sc, mn, b.scales);
  memset(b.qh, 0, sizeof(b.qh));
  for (int j = 0; j < 4; ++j) {
    for (int l = 0; l < 32; ++l) {
      const int lo = q[j * 64 + l], hi = q[j * 64 + 32 + l];
      b.qs[j * 32 + l] = static_cast<uint8_t>((lo & 0xF) | ((hi & 0xF) << 4));
      if (lo & 0x10) b.qh[l] |= static_cast<uint8_t>(1u << (2 * j));
      if (hi & 0x10) b.qh[l] |= static_cast<uint8_t>(2u << (2 * j));
    }
  }
  memcpy(p, &b, sizeof(b));
}

void QuantizeQ6_K(const float* x, uint8_t* p) {
  float sub_scale[16];
  float max_scale = 0.0f;
  for (int s = 0; s < 16; ++s) {
    float amax = 0.0f;
    for (int l = 0; l < 16; ++l) amax = std::max(amax, std::fabs(x[s * 16 + l]));
    sub_scale[s] = amax / 31.0f;
    max_scale = std::max(max_scale, sub_scale[s]);
  }
  const float d = Fp16ToFp32(Fp32ToFp16(max_scale / 127.0f));
  BlockQ6_K b;
  b.d = Fp32ToFp16(d);
  uint8_t q[kQKK];
  for (int s = 0; s < 16; ++s) {
    const int sc = d > 0 ? ClampRound(sub_scale[s] / d, 0, 127) : 0;
    b.scales[s] = static_cast<int8_t>(sc);
    const float ds = d * static_cast<float>(sc);
    for (int l = 0; l < 16; ++l) {
      q[s * 16 + l] = static_cast<uint8_t>((ds > 0 ? ClampRound(x[s * 16 + l] / ds, -32, 31) : 0) + 32);
    }
  }
  for (int half = 0; half < 2; ++half) {
    const uint8_t* qq = q + half * 128;
    uint8_t* ql = b.ql + half * 64;
    uint8_t* qh = b.qh + half * 32;
    for (int l = 0; l < 32; ++l) {
      ql[l] = static_cast<uint8_t>((qq[l] & 0xF) | ((qq[l + 64] & 0xF) << 4));
      ql[l + 32] = static_cast<uint8_t>((qq[l + 32] & 0xF) | ((qq[l + 96] & 0xF) << 4));
      qh[l] = static_cast<uint8_t>((qq[l] >> 4) | ((qq[l + 32] >> 4) << 2) | ((qq[l + 64] >> 4) << 4) |
                                   ((qq[l + 96] >> 4) << 6));
    }
  }
  memcpy(p, &b, sizeof(b));
}

// The block types' codecs: one block of type_size bytes <-> block_size floats.
struct BlockCodec {
  GgmlType type;
  void (*decode)(const uint8_t*, float*);
  void (*encode)(const float*, uint8_t*);
};

constexpr BlockCodec kCodecs[] = {
    {GgmlType::kQ4_0, DecodeQ4_0, QuantizeQ4_0}, {GgmlType::kQ4_1, DecodeQ4_1, QuantizeQ4_1},
    {GgmlType::kQ5_0, DecodeQ5_0, QuantizeQ5_0}, {GgmlType::kQ5_1, DecodeQ5_1, QuantizeQ5_1},
    {GgmlType::kQ8_0, DecodeQ8_0, QuantizeQ8_0}, {GgmlType::kQ4_K, DecodeQ4_K, QuantizeQ4_K},
    {GgmlType::kQ5_K, DecodeQ5_K, QuantizeQ5_K}, {GgmlType::kQ6_K, DecodeQ6_K, QuantizeQ6_K},
};

const BlockCodec* CodecFor(GgmlType type) {
  for (const BlockCodec& c : kCodecs) {
    if (c.type == type) return &c;
  }
  return nullptr;
}

}  // namespace

absl::Status CheckRow(GgmlType type, int64_t n) {
  const GgmlTypeTraits* t = GetTypeTraits(static_cast<uint32_t>(type));
  if (t == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("unknown ggml type ", static_cast<uint32_t>(type)));
  }
  if (!t->supported) {
    return absl::UnimplementedError(absl::StrCat("tensor type ", t->name,
                                                 " is not supported (supported: f32, f16, "
                                                 "bf16, q4_0, q4_1, q5_0, q5_1, q8_0, q4_K, q5_K, q6_K)"));
  }
  if (n < 0 || n % t->block_size != 0) {
    return absl::InvalidArgumentError(absl::StrCat("row of ", n, " elements is not a whole number of ",
                                                   t->name, " blocks of ", t->block_size));
  }
  return absl::OkStatus();
}

const GgmlTypeTraits* GetTypeTraits(uint32_t raw) {
  for (const TraitsEntry& e : kTraits) {
    if (e.raw == raw) return &e.traits;
  }
  return nullptr;
}

const GgmlTypeTraits& TypeTraits(GgmlType type) { return *GetTypeTraits(static_cast<uint32_t>(type)); }

absl::string_view TypeName(GgmlType type) {
  const GgmlTypeTraits* t = GetTypeTraits(static_cast<uint32_t>(type));
  return t == nullptr ? "unknown" : t->name;
}

absl::StatusOr<int64_t> RowBytes(GgmlType type, int64_t n) {
  const GgmlTypeTraits* t = GetTypeTraits(static_cast<uint32_t>(type));
  if (t == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("unknown ggml type ", static_cast<uint32_t>(type)));
  }
  if (n < 0 || n % t->block_size != 0) {
    return absl::InvalidArgumentError(absl::StrCat("row of ", n, " elements is not a whole number of ",
                                                   t->name, " blocks of ", t->block_size));
  }
  const int64_t blocks = n / t->block_size;
  if (blocks > std::numeric_limits<int64_t>::max() / t->type_size) {
    return absl::InvalidArgumentError(absl::StrCat("row of ", n, " elements overflows"));
  }
  return blocks * t->type_size;
}

absl::Status DequantizeRow(GgmlType type, const void* src, float* dst, int64_t n) {
  if (absl::Status s = CheckRow(type, n); !s.ok()) return s;
  const auto* p = static_cast<const uint8_t*>(src);
  switch (type) {
    case GgmlType::kF32:
      memcpy(dst, p, static_cast<size_t>(n) * sizeof(float));
      return absl::OkStatus();
    case GgmlType::kF16:
      for (int64_t i = 0; i < n; ++i) dst[i] = Fp16ToFp32(LoadU16(p + 2 * i));
      return absl::OkStatus();
    case GgmlType::kBF16:
      for (int64_t i = 0; i < n; ++i) dst[i] = Bf16ToFp32(LoadU16(p + 2 * i));
      return absl::OkStatus();
    default:
      break;
  }
  const GgmlTypeTraits& t = TypeTraits(type);
  const BlockCodec* codec = CodecFor(type);  // every supported block type has one
  for (int64_t b = 0; b < n / t.block_size; ++b) {
    codec->decode(p + b * t.type_size, dst + b * t.block_size);
  }
  return absl::OkStatus();
}

absl::StatusOr<float> VecDot(GgmlType type, const void* row, const float* x, int64_t n) {
  if (absl::Status s = CheckRow(type, n); !s.ok()) return s;
  const GgmlTypeTraits& t = TypeTraits(type);
  const auto* p = static_cast<const uint8_t*>(row);
  float buf[kQKK];
  double sum = 0.0;
  // Plain types go through DequantizeRow in chunks of kQKK elements.
  const int64_t chunk = t.block_size == 1 ? kQKK : t.block_size;
  for (int64_t i = 0; i < n; i += chunk) {
    const int64_t m = std::min<int64_t>(chunk, n - i);
    const int64_t offset = i / t.block_size * t.type_size;
    if (absl::Status s = DequantizeRow(type, p + offset, buf, m); !s.ok()) return s;
    for (int64_t j = 0; j < m; ++j) sum += static_cast<double>(buf[j]) * x[i + j];
  }
  return static_cast<float>(sum);
}

absl::Status QuantizeRow(GgmlType type, const float* src, void* dst, int64_t n) {
  if (absl::Status s = CheckRow(type, n); !s.ok()) return s;
  auto* p = static_cast<uint8_t*>(dst);
  switch (type) {
    case GgmlType::kF32:
      memcpy(p, src, static_cast<size_t>(n) * sizeof(float));
      return absl::OkStatus();
    case GgmlType::kF16:
      for (int64_t i = 0; i < n; ++i) StoreU16(p + 2 * i, Fp32ToFp16(src[i]));
      return absl::OkStatus();
    case GgmlType::kBF16:
      for (int64_t i = 0; i < n; ++i) StoreU16(p + 2 * i, Fp32ToBf16(src[i]));
      return absl::OkStatus();
    default:
      break;
  }
  const BlockCodec* codec = CodecFor(type);
  if (codec == nullptr) {
    return absl::UnimplementedError(absl::StrCat("no quantiser for tensor type ", TypeName(type)));
  }
  const GgmlTypeTraits& t = TypeTraits(type);
  for (int64_t b = 0; b < n / t.block_size; ++b) {
    codec->encode(src + b * t.block_size, p + b * t.type_size);
  }
  return absl::OkStatus();
}

}  // namespace gguf
}  // namespace kvcache
