// IEEE half (f16) and bfloat16 (bf16) conversions, bit-exact with ggml.
//
// Usable from host code and, later, CUDA device code: every function is
// KV_HD (`__host__ __device__` under nvcc, nothing otherwise) and touches no
// global state.
//
// Thread-safety: pure functions, safe from any thread.
#ifndef KVCACHE_COMMON_GGUF_FP16_H_
#define KVCACHE_COMMON_GGUF_FP16_H_

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#define KV_HD __host__ __device__
#else
#define KV_HD
#endif

namespace kvcache {
namespace gguf {

KV_HD inline float BitsToFloat(uint32_t bits) {
  float f;
  memcpy(&f, &bits, sizeof(f));
  return f;
}

KV_HD inline uint32_t FloatToBits(float f) {
  uint32_t bits;
  memcpy(&bits, &f, sizeof(bits));
  return bits;
}

// Exact: every f16 value (subnormals, infinities, NaN payloads) has an f32. In
// device code, the hardware conversion (the same value for every non-NaN half).
KV_HD inline float Fp16ToFp32(uint16_t h) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(h));
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return BitsToFloat(sign | 0x7f800000u | (mant << 13));
  if (exp != 0) return BitsToFloat(sign | ((exp + 112u) << 23) | (mant << 13));
  if (mant == 0) return BitsToFloat(sign);
  // Subnormal: normalise the mantissa.
  int e = -1;
  do {
    ++e;
    mant <<= 1;
  } while ((mant & 0x400u) == 0);
  return BitsToFloat(sign | (static_cast<uint32_t>(112 - e) << 23) | ((mant & 0x3ffu) << 13));
#endif
}

// Round to nearest, ties to even; overflow gives infinity; NaN stays NaN.
KV_HD inline uint16_t Fp32ToFp16(float f) {
  const uint32_t x = FloatToBits(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t abs = x & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (abs >= 0x47800000u) {  // >= 65536: inf (also rounds to inf above 65520)
    return static_cast<uint16_t>(sign | 0x7c00u);
  }
  if (abs < 0x38800000u) {               // below the smallest normal f16 (2^-14)
    if (abs < 0x33000000u) return sign;  // below half the smallest subnormal
    const uint32_t e = abs >> 23;
    const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - e;  // 14..24
    uint32_t half = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u);
    const uint32_t halfway = 1u << (shift - 1u);
    if (rem > halfway || (rem == halfway && (half & 1u))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t half = ((abs >> 13) - (112u << 10));
  const uint32_t rem = abs & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (half & 1u))) ++half;  // may carry into inf
  return static_cast<uint16_t>(sign | half);
}

KV_HD inline float Bf16ToFp32(uint16_t b) { return BitsToFloat(static_cast<uint32_t>(b) << 16); }

// Round to nearest even, NaN kept quiet (same rule as ggml_compute_fp32_to_bf16).
KV_HD inline uint16_t Fp32ToBf16(float f) {
  uint32_t x = FloatToBits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 64u);
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}

}  // namespace gguf
}  // namespace kvcache

#endif  // KVCACHE_COMMON_GGUF_FP16_H_
