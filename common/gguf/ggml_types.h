// ggml tensor element types: block layouts, sizes, dequantisation, scalar
// reference dot products and reference quantisers.
//
// The block structs match ggml's byte layout exactly (they are read straight
// out of memory-mapped GGUF files). The functions here are the slow, obviously
// correct reference; vectorised kernels elsewhere are tested against them.
//
// Thread-safety: pure functions over caller-owned buffers, safe from any thread.
#ifndef KVCACHE_COMMON_GGUF_GGML_TYPES_H_
#define KVCACHE_COMMON_GGUF_GGML_TYPES_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvcache {
namespace gguf {

// Values are ggml's `enum ggml_type` (they are stored in GGUF files).
enum class GgmlType : uint32_t {
  kF32 = 0,
  kF16 = 1,
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ8_1 = 9,
  kQ2_K = 10,
  kQ3_K = 11,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
  kQ8_K = 15,
  kI8 = 24,
  kI16 = 25,
  kI32 = 26,
  kI64 = 27,
  kF64 = 28,
  kBF16 = 30,
};

// Static facts about a type. `supported` is true for the types this library
// can dequantise (DequantizeRow / VecDot succeed for them).
struct GgmlTypeTraits {
  const char* name;    // ggml's name, e.g. "q4_1"
  int64_t block_size;  // elements per block (1 for plain types)
  int64_t type_size;   // bytes per block
  bool supported;
};

// Returns the traits of `raw`, or nullptr when ggml has no such type.
const GgmlTypeTraits* GetTypeTraits(uint32_t raw);
const GgmlTypeTraits& TypeTraits(GgmlType type);  // REQUIRES: a known type
absl::string_view TypeName(GgmlType type);

// Bytes of a row of `n` elements. INVALID_ARGUMENT when n is negative, not a
// multiple of the block size, or the byte count overflows int64.
absl::StatusOr<int64_t> RowBytes(GgmlType type, int64_t n);

// ---- Block layouts (ggml, QK4_0 = QK5_0 = QK8_0 = 32, QK_K = 256) ----
constexpr int kQK = 32;
constexpr int kQKK = 256;
constexpr int kKScaleBytes = 12;

struct BlockQ4_0 {      // x = (q - 8) * d
  uint16_t d;           // f16
  uint8_t qs[kQK / 2];  // low nibbles: elements 0..15, high: 16..31
};
struct BlockQ4_1 {  // x = q * d + m
  uint16_t d;
  uint16_t m;
  uint8_t qs[kQK / 2];
};
struct BlockQ5_0 {  // x = (q - 16) * d, q = nibble | (bit of qh) << 4
  uint16_t d;
  uint8_t qh[4];
  uint8_t qs[kQK / 2];
};
struct BlockQ5_1 {  // x = q * d + m
  uint16_t d;
  uint16_t m;
  uint8_t qh[4];
  uint8_t qs[kQK / 2];
};
struct BlockQ8_0 {  // x = q * d
  uint16_t d;
  int8_t qs[kQK];
};
struct BlockQ4_K {  // 8 sub-blocks of 32 with 6-bit scales and mins
  uint16_t d;
  uint16_t dmin;
  uint8_t scales[kKScaleBytes];
  uint8_t qs[kQKK / 2];
};
struct BlockQ5_K {
  uint16_t d;
  uint16_t dmin;
  uint8_t scales[kKScaleBytes];
  uint8_t qh[kQKK / 8];
  uint8_t qs[kQKK / 2];
};
struct BlockQ6_K {  // 16 sub-blocks of 16 with int8 scales
  uint8_t ql[kQKK / 2];
  uint8_t qh[kQKK / 4];
  int8_t scales[kQKK / 16];
  uint16_t d;
};

static_assert(sizeof(BlockQ4_0) == 18, "ggml layout");
static_assert(sizeof(BlockQ4_1) == 20, "ggml layout");
static_assert(sizeof(BlockQ5_0) == 22, "ggml layout");
static_assert(sizeof(BlockQ5_1) == 24, "ggml layout");
static_assert(sizeof(BlockQ8_0) == 34, "ggml layout");
static_assert(sizeof(BlockQ4_K) == 144, "ggml layout");
static_assert(sizeof(BlockQ5_K) == 176, "ggml layout");
static_assert(sizeof(BlockQ6_K) == 210, "ggml layout");

// OK when DequantizeRow decodes rows of `n` elements of `type`: UNIMPLEMENTED
// (naming the types it decodes) for a type it cannot decode, INVALID_ARGUMENT
// for an unknown type or when n is not a whole number of blocks.
absl::Status CheckRow(GgmlType type, int64_t n);

// Decodes `n` elements of `type` at `src` into `dst` (float). `src` need not
// be aligned.
// REQUIRES: src holds RowBytes(type, n) bytes, dst holds n floats.
// UNIMPLEMENTED for a type this library cannot decode, INVALID_ARGUMENT when n
// is not a whole number of blocks.
absl::Status DequantizeRow(GgmlType type, const void* src, float* dst, int64_t n);

// Scalar reference dot product sum_i dequant(row)[i] * x[i], accumulated in
// double over blocks in order. Same errors as DequantizeRow.
// REQUIRES: row holds RowBytes(type, n) bytes, x holds n floats.
absl::StatusOr<float> VecDot(GgmlType type, const void* row, const float* x, int64_t n);

// Reference round-to-nearest quantiser (used by the GGUF writer to build test
// models). Supports F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K,
// Q6_K; other types are UNIMPLEMENTED. Results are valid blocks that
// DequantizeRow decodes to close approximations of `src`, not bit-identical to
// ggml's (search-based) K-quant quantisers.
// REQUIRES: dst holds RowBytes(type, n) bytes.
absl::Status QuantizeRow(GgmlType type, const float* src, void* dst, int64_t n);

}  // namespace gguf
}  // namespace kvcache

#endif  // KVCACHE_COMMON_GGUF_GGML_TYPES_H_
