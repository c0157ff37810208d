// Decoding of ggml rows eight elements at a time, from host or CUDA device code.
//
// The CUDA backend keeps weights in their file encoding on the device, and its
// kernels decode them per thread with these functions: a chunk is 8 consecutive
// elements of a row, and every block type's chunk shares one scale (and one
// min), so a thread decodes a chunk with one scale load and one operation per
// element. The values are DequantizeRow's (ggml_types.h) bit for bit, with the
// same float operations as ggml's dequantize_row_*
// (DequantChunkTest.EveryChunkOfEverySupportedTypeEqualsDequantizeRow). The host
// keeps its block decoders: whole 32- and 256-value blocks vectorise, and for
// Q4_0, Q4_1, Q8_0, Q4_K and Q5_K they ran 2-7x faster per element than chunks
// (0.14-0.36 ns against 0.5-1.4 ns; the scalar kernel level dequantises every
// weight per call through them).
//
// Thread-safety: pure functions over caller-owned bytes.
#ifndef KVCACHE_COMMON_GGUF_DEQUANT_CHUNK_H_
#define KVCACHE_COMMON_GGUF_DEQUANT_CHUNK_H_

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "common/gguf/fp16.h"
#include "common/gguf/ggml_types.h"

namespace kvcache {
namespace gguf {

inline constexpr int kChunk = 8;

namespace chunk_internal {

KV_HD inline float HalfAt(const uint8_t* p) {
  uint16_t h;
  memcpy(&h, p, sizeof(h));
  return Fp16ToFp32(h);
}

// 6-bit scale and min number j (0..7) of a Q4_K/Q5_K super-block's 12 scale bytes.
KV_HD inline void ScaleMinK4(int j, const uint8_t* q, int* sc, int* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

}  // namespace chunk_internal

// out[i] = element kChunk * chunk + i of the row starting at `row`, for i < 8.
// REQUIRES: Type is ChunkDecodable; the row holds at least kChunk * (chunk + 1)
// elements. `row` need not be aligned.
template <GgmlType Type>
KV_HD inline void DequantChunk8(const uint8_t* row, int64_t chunk, float* out) {
  using chunk_internal::HalfAt;
  const int64_t e = chunk * kChunk;  // first element
  if constexpr (Type == GgmlType::kF32) {
    memcpy(out, row + e * 4, kChunk * sizeof(float));
  } else if constexpr (Type == GgmlType::kF16 || Type == GgmlType::kBF16) {
    uint16_t h[kChunk];
    memcpy(h, row + e * 2, sizeof(h));
    for (int i = 0; i < kChunk; ++i) out[i] = Type == GgmlType::kF16 ? Fp16ToFp32(h[i]) : Bf16ToFp32(h[i]);
  } else if constexpr (Type == GgmlType::kQ4_0 || Type == GgmlType::kQ4_1) {
    using Block = std::conditional_t<Type == GgmlType::kQ4_0, BlockQ4_0, BlockQ4_1>;
    const uint8_t* b = row + (e / kQK) * sizeof(Block);
    const int o = static_cast<int>(e % kQK);  // 0, 8, 16, 24: low nibbles, then high
    const float d = HalfAt(b);
    const uint8_t* qs = b + offsetof(Block, qs) + (o & 15);
    const int shift = o < 16 ? 0 : 4;
    if constexpr (Type == GgmlType::kQ4_0) {
      for (int i = 0; i < kChunk; ++i) out[i] = static_cast<float>(((qs[i] >> shift) & 0xF) - 8) * d;
    } else {
      const float m = HalfAt(b + offsetof(BlockQ4_1, m));
      for (int i = 0; i < kChunk; ++i) out[i] = static_cast<float>((qs[i] >> shift) & 0xF) * d + m;
    }
  } else if constexpr (Type == GgmlType::kQ5_0 || Type == GgmlType::kQ5_1) {
    using Block = std::conditional_t<Type == GgmlType::kQ5_0, BlockQ5_0, BlockQ5_1>;
    const uint8_t* b = row + (e / kQK) * sizeof(Block);
    const int o = static_cast<int>(e % kQK);
    const float d = HalfAt(b);
    uint32_t qh;
    memcpy(&qh, b + offsetof(Block, qh), sizeof(qh));
    const uint8_t* qs = b + offsetof(Block, qs) + (o & 15);
    const int shift = o < 16 ? 0 : 4;
    float m = 0.0f;
    if constexpr (Type == GgmlType::kQ5_1) m = HalfAt(b + offsetof(BlockQ5_1, m));
    for (int i = 0; i < kChunk; ++i) {
      // Element o + i takes bit o + i of qh as its fifth bit.
      const int q = ((qs[i] >> shift) & 0xF) | static_cast<int>(((qh >> (o + i)) & 1u) << 4);
      if constexpr (Type == GgmlType::kQ5_0) {
        out[i] = static_cast<float>(q - 16) * d;
      } else {
        out[i] = static_cast<float>(q) * d + m;
      }
    }
  } else if constexpr (Type == GgmlType::kQ8_0) {
    const uint8_t* b = row + (e / kQK) * sizeof(BlockQ8_0);
    const float d = HalfAt(b);
    int8_t qs[kChunk];
    memcpy(qs, b + 2 + e % kQK, sizeof(qs));
    for (int i = 0; i < kChunk; ++i) out[i] = static_cast<float>(qs[i]) * d;
  } else if constexpr (Type == GgmlType::kQ4_K || Type == GgmlType::kQ5_K) {
    // Super-block of 256: pairs of 32-element sub-blocks share 32 qs bytes, the
    // first sub-block in the low nibbles, the second in the high ones.
    using Block = std::conditional_t<Type == GgmlType::kQ4_K, BlockQ4_K, BlockQ5_K>;
    const uint8_t* b = row + (e / kQKK) * sizeof(Block);
    const int o = static_cast<int>(e % kQKK);
    const int sub = o / 32;  // 0..7
    const int l = o % 32;    // 0, 8, 16, 24
    int sc, m;
    chunk_internal::ScaleMinK4(sub, b + offsetof(Block, scales), &sc, &m);
    const float d1 = HalfAt(b + offsetof(Block, d)) * static_cast<float>(sc);
    const float m1 = HalfAt(b + offsetof(Block, dmin)) * static_cast<float>(m);
    const uint8_t* qs = b + offsetof(Block, qs) + (sub / 2) * 32 + l;
    const int shift = (sub & 1) * 4;
    for (int i = 0; i < kChunk; ++i) {
      int q = (qs[i] >> shift) & 0xF;
      if constexpr (Type == GgmlType::kQ5_K) {
        q += ((b[offsetof(BlockQ5_K, qh) + l + i] >> sub) & 1) << 4;  // bit `sub` of qh[l + i]
      }
      out[i] = d1 * static_cast<float>(q) - m1;
    }
  } else if constexpr (Type == GgmlType::kQ6_K) {
    // Halves of 128: ql[64] qh[32] scales[8]; quarter k of a half takes ql's low
    // (k = 0, 1) or high (k = 2, 3) nibbles at offset 32 (k odd), and qh's bits 2k..2k+1.
    const uint8_t* b = row + (e / kQKK) * sizeof(BlockQ6_K);
    const int o = static_cast<int>(e % kQKK);
    const int half = o / 128, quarter = (o % 128) / 32, l = o % 32;
    const uint8_t* ql = b + offsetof(BlockQ6_K, ql) + half * 64 + (quarter & 1) * 32 + l;
    const uint8_t* qh = b + offsetof(BlockQ6_K, qh) + half * 32 + l;
    const int8_t sc = static_cast<int8_t>(b[offsetof(BlockQ6_K, scales) + half * 8 + l / 16 + 2 * quarter]);
    const float d = HalfAt(b + offsetof(BlockQ6_K, d));
    const int shift_l = (quarter >> 1) * 4, shift_h = 2 * quarter;
    for (int i = 0; i < kChunk; ++i) {
      const int q = (((ql[i] >> shift_l) & 0xF) | (((qh[i] >> shift_h) & 3) << 4)) - 32;
      out[i] = d * sc * static_cast<float>(q);
    }
  } else {
    static_assert(Type == GgmlType::kF32, "DequantChunk8: type without a chunk decoder");
  }
}

// The type of a chunk decoder as a value a generic lambda can read at compile
// time: [&](auto tag) { DequantChunk8<decltype(tag)::value>(...); }.
template <GgmlType Type>
using ChunkTypeTag = std::integral_constant<GgmlType, Type>;

namespace chunk_internal {
template <GgmlType... Types, typename Fn>
bool VisitOneOf(GgmlType type, Fn& fn) {
  return ((type == Types ? (fn(ChunkTypeTag<Types>{}), true) : false) || ...);
}
}  // namespace chunk_internal

// Calls fn(ChunkTypeTag<type>{}) when `type` is ChunkDecodable and returns true;
// otherwise returns false. Lets a caller (a host loop, a kernel launcher) pick the
// decoder once, outside its loop over chunks.
template <typename Fn>
inline bool VisitChunkType(GgmlType type, Fn&& fn) {
  return chunk_internal::VisitOneOf<GgmlType::kF32, GgmlType::kF16, GgmlType::kBF16, GgmlType::kQ4_0,
                                    GgmlType::kQ4_1, GgmlType::kQ5_0, GgmlType::kQ5_1, GgmlType::kQ8_0,
                                    GgmlType::kQ4_K, GgmlType::kQ5_K, GgmlType::kQ6_K>(type, fn);
}

// The types DequantChunk8 decodes: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
// Q4_K, Q5_K and Q6_K (every type with GgmlTypeTraits::supported).
inline bool ChunkDecodable(GgmlType type) {
  return VisitChunkType(type, [](auto) {});
}

}  // namespace gguf
}  // namespace kvcache

#endif  // KVCACHE_COMMON_GGUF_DEQUANT_CHUNK_H_
