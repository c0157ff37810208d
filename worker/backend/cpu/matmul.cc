#include "worker/backend/cpu/matmul.h"

#include <cblas.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <mutex>
#include <type_traits>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "common/gguf/fp16.h"
#include "common/status_macros.h"
#include "worker/backend/cpu/compute_pool.h"
#include "worker/backend/cpu/cpu_features.h"

namespace kvcache::cpu {
namespace {

using gguf::GgmlType;

// A quantised-weight x Q8-activation product, as every level's kernels see it.
struct QuantJob {
  GgmlType type;      // IsIntegerDotType(type)
  const uint8_t* w;   // [rows][w_stride bytes]
  const uint8_t* wi;  // InterleaveRows16(w) (rows / 16 groups), or nullptr
  int64_t rows;
  int64_t w_stride;  // RowBytes(type, cols)
  int64_t nb;        // 32-blocks per row = cols / 32 (a multiple of 8 for k-quants)
  int n_tokens;
  // Null when no kernel of the call reads rows (RunQuantProducts).
  const int8_t* aq;   // [n_tokens][cols]
  const float* ad;    // [n_tokens][nb]
  const float* as;    // [n_tokens][nb]
  const int32_t* ai;  // [n_tokens][nb][2]: sum of each 16 qa (for aot, below)
  // The same values per token tile (TileTokens), as the interleaved tiles read
  // them: tile [t0, t0 + T) at aqt + t0 * cols, token t0 + t's block b at
  // (b * T + t) * 32 bytes from there; its ad/as at adt/ast + t0 * nb + b * T + t,
  // its ai at ait + (t0 * nb + b * T + t) * 2 (null when no product of the call
  // has interleaved weights, which read them, ait through aot). All of a block's
  // tokens then lie at fixed offsets from one pointer. With a row pointer per
  // token, the 8-token AVX-512 tile kept 8 of them, spilled them, and spent ~45
  // scalar ops per block on addresses (now 8). engine_bench step matmuls of 16 tokens, SmolLM2 Q4_1,
  // Intel Xeon, three runs alternating: 8.9-9.2 -> 7.9-8.5 ms at avx512,
  // 19.0-19.5 -> 17.9-18.1 ms at avx2.
  const int8_t* aqt;
  const float* adt;
  const float* ast;
  const int32_t* ait;
  // For a type whose tiles read offset weights (its TileOffset o at this level is
  // not 0): per token and block, in ait's order, 3 int32 that the tiles' integer
  // sums start from: -o times each of its two sums, and -o times their total
  // (RunQuantProducts; null for other types).
  const int32_t* aot;
  float* y;  // [n_tokens][y_stride]
  int64_t y_stride;
};

// Tokens in the tile that starts at token t0 of n, for a level whose widest
// tile is `width`: whole tiles, then 4 if that many are left, then the rest.
// SourceAllTokens runs tiles in this order, and RunQuantProducts lays out
// QuantJob::aqt by it.
constexpr int TileTokens(int n, int t0, int width) {
  return n - t0 >= width ? width : n - t0 >= 4 ? 4 : n - t0;
}

// Rows per group of InterleaveRows16 (one zmm of f32 lanes; two ymm halves).
constexpr int kInterleaveRows = 16;
// Byte offsets in a group super-block of InterleaveRows16's k-quant layouts, which
// InterleaveKRows16 / InterleaveQ6KRows16 write and the kernels read.
// Q4_K/Q5_K: d[16] f16 at 0, dmin[16] at 32, per sub-block j the 16 scales then
// the 16 mins at kIKScales + 32 j, Q5_K's fifth bits at kIK5Qh (8 steps of 64),
// then the quants (4 pairs of sub-blocks x 8 steps of 64).
constexpr int64_t kIKScales = 64;
constexpr int64_t kIK5Qh = kIKScales + 8 * 32;
constexpr int64_t kIK4Qs = kIK5Qh;
constexpr int64_t kIK5Qs = kIK5Qh + 8 * 64;
// Q6_K: d[16] at 0, the 16 sub-blocks' scales at kIQ6Scales + 16 i, ql (4 chunks
// x 8 steps of 64) at kIQ6Ql, qh (2 chunks x 8 steps) at kIQ6Qh.
constexpr int64_t kIQ6Scales = 32;
constexpr int64_t kIQ6Ql = kIQ6Scales + 16 * 16;
constexpr int64_t kIQ6Qh = kIQ6Ql + 4 * 8 * 64;

// ---- Scalar reference kernels (level kScalar) ----

void QuantizeRowQ8Scalar(const float* x, int64_t cols, int8_t* q, float* d, float* s, int32_t* sums16,
                         int64_t stride) {
  for (int64_t b = 0; b < cols / 32; ++b) {
    float amax = 0.0f;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[b * 32 + i]));
    const float dd = amax / 127.0f;
    const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
    int sum[2] = {0, 0};
    for (int i = 0; i < 32; ++i) {
      const int v = static_cast<int>(std::nearbyint(x[b * 32 + i] * id));
      q[b * stride * 32 + i] = static_cast<int8_t>(v);
      sum[i / 16] += v;
    }
    d[b * stride] = dd;
    s[b * stride] = dd * static_cast<float>(sum[0] + sum[1]);
    if (sums16 != nullptr) {
      sums16[2 * b * stride] = sum[0];
      sums16[2 * b * stride + 1] = sum[1];
    }
  }
}

// 6-bit scale and min of sub-block j (0..7) of a Q4_K/Q5_K super-block's 12 scale
// bytes: j < 4 in the low 6 bits of bytes j and j + 4; j >= 4 in the nibbles of
// byte j + 4 with the top 2 bits of bytes j - 4 and j.
void ScaleMinK4Scalar(int j, const uint8_t* q, int* scale, int* min) {
  if (j < 4) {
    *scale = q[j] & 63;
    *min = q[j + 4] & 63;
  } else {
    *scale = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// Block b (32 values) of a row of an integer-dot type, written as
//   w[i] = dw[i / 16] * q[i] + mw
// as the SIMD kernels see it (matmul_x86.inc): Q4_0 and Q5_0 keep q unsigned and
// their offsets in mw, so that this reference rounds as the AVX2 kernels do.
void WeightBlockScalar(GgmlType type, const uint8_t* row, int64_t b, int q[32], float dw[2], float* mw) {
  *mw = 0.0f;
  dw[0] = 0.0f;
  switch (type) {
    case GgmlType::kQ4_0: {  // x = nibble d - 8 d; low nibbles are values 0..15
      const auto& blk = reinterpret_cast<const gguf::BlockQ4_0*>(row)[b];
      for (int i = 0; i < 16; ++i) {
        q[i] = blk.qs[i] & 0xF;
        q[i + 16] = blk.qs[i] >> 4;
      }
      dw[0] = gguf::Fp16ToFp32(blk.d);
      *mw = -8.0f * dw[0];
      break;
    }
    case GgmlType::kQ4_1: {  // x = nibble d + m
      const auto& blk = reinterpret_cast<const gguf::BlockQ4_1*>(row)[b];
      for (int i = 0; i < 16; ++i) {
        q[i] = blk.qs[i] & 0xF;
        q[i + 16] = blk.qs[i] >> 4;
      }
      dw[0] = gguf::Fp16ToFp32(blk.d);
      *mw = gguf::Fp16ToFp32(blk.m);
      break;
    }
    case GgmlType::kQ5_0: {  // x = (nibble | bit i of qh << 4) d - 16 d
      const auto& blk = reinterpret_cast<const gguf::BlockQ5_0*>(row)[b];
      uint32_t qh;
      std::memcpy(&qh, blk.qh, sizeof(qh));
      for (int i = 0; i < 16; ++i) {
        q[i] = (blk.qs[i] & 0xF) | (((qh >> i) & 1) << 4);
        q[i + 16] = (blk.qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4);
      }
      dw[0] = gguf::Fp16ToFp32(blk.d);
      *mw = -16.0f * dw[0];
      break;
    }
    case GgmlType::kQ8_0: {
      const auto& blk = reinterpret_cast<const gguf::BlockQ8_0*>(row)[b];
      for (int i = 0; i < 32; ++i) q[i] = blk.qs[i];
      dw[0] = gguf::Fp16ToFp32(blk.d);
      break;
    }
    case GgmlType::kQ4_K:
    case GgmlType::kQ5_K: {
      // Sub-block j of a 256 super-block: value l is the low (j even) or high (j odd)
      // nibble of qs[32 (j / 2) + l], plus 16 x bit j of qh[l] for Q5_K;
      // x = d scale_j q - dmin min_j.
      const int j = static_cast<int>(b % 8);
      const bool five = type == GgmlType::kQ5_K;
      const uint8_t* blk = row + (b / 8) * (five ? sizeof(gguf::BlockQ5_K) : sizeof(gguf::BlockQ4_K));
      uint16_t d, dmin;
      std::memcpy(&d, blk, 2);
      std::memcpy(&dmin, blk + 2, 2);
      const uint8_t* scales = blk + 4;
      const uint8_t* qs = blk + (five ? offsetof(gguf::BlockQ5_K, qs) : offsetof(gguf::BlockQ4_K, qs));
      const uint8_t* qh = blk + offsetof(gguf::BlockQ5_K, qh);
      for (int l = 0; l < 32; ++l) {
        q[l] = (qs[32 * (j / 2) + l] >> (4 * (j & 1))) & 0xF;
        if (five) q[l] |= ((qh[l] >> j) & 1) << 4;
      }
      int scale, min;
      ScaleMinK4Scalar(j, scales, &scale, &min);
      dw[0] = gguf::Fp16ToFp32(d) * static_cast<float>(scale);
      *mw = -gguf::Fp16ToFp32(dmin) * static_cast<float>(min);
      break;
    }
    case GgmlType::kQ6_K: {
      // Block j = 4n + g of the super-block (half n, group g): value l has low 4 bits
      // in ql[64n + 32 (g & 1) + l] (high nibble when g >= 2) and high 2 bits at
      // qh[32n + l] >> 2g; x = d scales[2j + l / 16] (q - 32).
      const int j = static_cast<int>(b % 8), n = j / 4, g = j % 4;
      const auto& blk = reinterpret_cast<const gguf::BlockQ6_K*>(row)[b / 8];
      for (int l = 0; l < 32; ++l) {
        const int lo = (blk.ql[64 * n + 32 * (g & 1) + l] >> (4 * (g >> 1))) & 0xF;
        const int hi = (blk.qh[32 * n + l] >> (2 * g)) & 3;
        q[l] = (lo | (hi << 4)) - 32;
      }
      const float d = gguf::Fp16ToFp32(blk.d);
      dw[0] = d * static_cast<float>(blk.scales[2 * j]);
      dw[1] = d * static_cast<float>(blk.scales[2 * j + 1]);
      return;
    }
    default:
      break;
  }
  dw[1] = dw[0];
}

// The arithmetic that defines a product (the AVX2 kernels compute it bit for bit;
// see matmul_x86.inc): per block b in order, from acc = 0,
//   acc = fma(float(<q, qa>), dw * da, acc);  acc = fma(mw, s, acc)  (types with an m)
// or, for Q6_K, one fma per half of 16 values with that half's scale.
void RunQuantRowsScalar(const QuantJob& job, int64_t r_begin, int64_t r_end) {
  const int64_t cols = job.nb * 32;
  const bool two_scales = job.type == GgmlType::kQ6_K;
  const bool has_m = !two_scales && job.type != GgmlType::kQ8_0;
  int q[32];
  for (int64_t r = r_begin; r < r_end; ++r) {
    const uint8_t* row = job.w + r * job.w_stride;
    for (int t = 0; t < job.n_tokens; ++t) {
      const int8_t* aq = job.aq + t * cols;
      float acc = 0.0f;
      for (int64_t b = 0; b < job.nb; ++b) {
        float dw[2], mw;
        WeightBlockScalar(job.type, row, b, q, dw, &mw);
        int32_t dot[2] = {0, 0};
        for (int i = 0; i < 32; ++i) dot[i / 16] += q[i] * aq[b * 32 + i];
        const float da = job.ad[t * job.nb + b];
        if (two_scales) {
          acc = std::fma(static_cast<float>(dot[0]), dw[0] * da, acc);
          acc = std::fma(static_cast<float>(dot[1]), dw[1] * da, acc);
        } else {
          acc = std::fma(static_cast<float>(dot[0] + dot[1]), dw[0] * da, acc);
          if (has_m) acc = std::fma(mw, job.as[t * job.nb + b], acc);
        }
      }
      job.y[t * job.y_stride + r] = acc;
    }
  }
}

void RunF32RowsScalar(const float* w, int64_t w_stride, int64_t n_rows, int64_t cols, const float* x,
                      int64_t x_stride, int n_tokens, float* y, int64_t y_stride, int64_t r0) {
  for (int64_t r = 0; r < n_rows; ++r) {
    for (int t = 0; t < n_tokens; ++t) {
      float sum = 0.0f;
      for (int64_t c = 0; c < cols; ++c) sum += w[r * w_stride + c] * x[t * x_stride + c];
      y[t * y_stride + r0 + r] = sum;
    }
  }
}

bool DequantRowFastScalar(GgmlType, const void*, float*, int64_t) { return false; }

}  // namespace

// ---- SIMD kernels: the same source compiled for two ISA levels ----
#define KV_NS avx2
#define KV_TARGET __attribute__((target("avx2,fma,f16c")))
#define KV_VNNI 0
#define KV_R 2
namespace {
#include "worker/backend/cpu/matmul_x86.inc"
}  // namespace
#undef KV_NS
#undef KV_TARGET
#undef KV_VNNI
#undef KV_R

#define KV_NS avx512
#define KV_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))
#define KV_VNNI 1
#define KV_R 4
namespace {
#include "worker/backend/cpu/matmul_x86.inc"
}  // namespace
#undef KV_NS
#undef KV_TARGET
#undef KV_VNNI
#undef KV_R

namespace {

struct Kernels {
  // One activation row (QuantizeActivationsQ8), and into sums16 [cols / 16]
  // (when not null) the sum of each 16 q; block b's values at q + b * stride *
  // 32, d/s[b * stride] and sums16[2 * b * stride] (1: a row).
  void (*quantize_row)(const float* x, int64_t cols, int8_t* q, float* d, float* s, int32_t* sums16,
                       int64_t stride);
  int tile_tokens;  // the widest token tile of quant_rows (TileTokens)
  // Rows [r_begin, r_end) of the job.
  void (*quant_rows)(const QuantJob& job, int64_t r_begin, int64_t r_end);
  void (*f32_rows)(const float* w, int64_t w_stride, int64_t n_rows, int64_t cols, const float* x,
                   int64_t x_stride, int n_tokens, float* y, int64_t y_stride, int64_t r0);
  bool (*dequant_row_fast)(GgmlType type, const void* src, float* dst, int64_t n);
  // The offset o of a type's interleaved tiles (kOffset, matmul_x86.inc), 0 if none.
  int32_t (*tile_offset)(GgmlType type);
};

const Kernels& KernelsFor(CpuKernelLevel level) {
  static const Kernels kScalar = {QuantizeRowQ8Scalar,  1,
                                  RunQuantRowsScalar,   RunF32RowsScalar,
                                  DequantRowFastScalar, [](GgmlType) { return int32_t{0}; }};
  static const Kernels kAvx2 = {avx2::QuantizeRowQ8, avx2::kTileTokens,    avx2::RunQuantRows,
                                avx2::RunF32Rows,    avx2::DequantRowFast, avx2::TileOffset};
  static const Kernels kAvx512 = {avx512::QuantizeRowQ8, avx512::kTileTokens,    avx512::RunQuantRows,
                                  avx512::RunF32Rows,    avx512::DequantRowFast, avx512::TileOffset};
  switch (level) {
    case CpuKernelLevel::kAvx2:
      return kAvx2;
    case CpuKernelLevel::kAvx512:
      return kAvx512;
    default:
      return kScalar;
  }
}

// Rows per parallel work unit of the dot path (a multiple of every kR) and per
// dequantised sgemm tile (64 rows x cols f32 stays within L2 for cols <= 2048).
constexpr int64_t kDotRowChunk = 16;
static_assert(kDotRowChunk % kInterleaveRows == 0, "parts start at interleaved groups");
constexpr int64_t kSgemmRowTile = 64;
// Rows per loop index of the dot path, a guided schedule: each part takes
// 1 / (2 * n_threads) of the rows still left (a multiple of kDotRowChunk, at
// least one), so parts shrink as the loop goes on. The first parts are long
// contiguous runs (the hardware prefetcher and the kernels' next-tile prefetch
// follow one run), and the threads finish within one small part of each other,
// whichever started late or stalled. With 8 equal parts a thread waited up to
// an eighth of the loop: a 16-token step's product loops were busy 93% of their
// time on 2 threads, and 95% with these parts (SmolLM2 Q4_1, Intel Xeon, avx512).
int64_t RowsOfNextPart(int64_t rows_left, int n_threads) {
  const int64_t per = rows_left / (2 * int64_t{n_threads});
  return std::max(kDotRowChunk, (per + kDotRowChunk - 1) / kDotRowChunk * kDotRowChunk);
}

// Bytes of weight traffic below which one more thread costs more than it saves
// (a loop on the pool costs about a microsecond; 16 KiB of weights take one
// thread about as long). Measured with engine_bench decode on SmolLM2 Q4_1
// (2 threads, Intel Xeon, still on OpenMP with one team in the process):
// 16 KiB 182 tokens/s, 64 KiB 174, 256 KiB 138, 1 MiB (every per-layer matmul
// on one thread) 111; on ComputePool at 16 KiB, 164-185 over four runs.
constexpr int64_t kMinWorkPerThread = int64_t{1} << 14;

// Activation values up to which each thread of a RunQuantProducts loop quantises
// every token into buffers of its own, on its first part, instead of one shared
// quantisation that the loop waits for. The copy costs a thread a few
// microseconds that it would otherwise spend waiting, and its buffers stay in
// its own cache: writing shared buffers that the other core had read waited on
// each line's return (16 x 576 values: 2.4 us alone, 4.6 in a step, on one
// thread, where two threads' halves had cost more than they saved). The layers
// of engine_bench's 16-session steps (SmolLM2 Q4_1, Intel Xeon, 2 threads), the
// two routes alternating step by step in one process, ~160 steps each, two
// runs: median 8.04-8.10 -> 7.80-7.86 ms at avx512, 15.18-15.68 -> 15.14-15.39
// ms at avx2; one token's matmuls unchanged (cpu_kernels_bench --sections=decode,
// six runs alternating: 2.45-2.77 -> 2.46-2.65 ms at avx512). Larger sets (a
// prefill chunk) are quantised once, on the pool.
constexpr int64_t kMaxPerThreadQuantValues = int64_t{1} << 15;

// 0 = the measured default of the current level (see SgemmMinTokens()).
std::atomic<int> g_sgemm_min_tokens{0};

// Scratch that lives per thread, grown on demand, never shrunk.
std::vector<float>& ThreadScratch(int which) {
  thread_local std::vector<float> bufs[2];
  return bufs[which];
}

absl::Status DequantRow(const Kernels& k, GgmlType type, const void* src, float* dst, int64_t n) {
  if (k.dequant_row_fast(type, src, dst, n)) return absl::OkStatus();
  return gguf::DequantizeRow(type, src, dst, n);
}

// Threads for products of `weight_bytes` with n_tokens tokens: work ~ weight
// bytes x token tiles; tiny products stay on the calling thread.
int ThreadsFor(int64_t weight_bytes, int n_tokens) {
  const int64_t work = weight_bytes * ((n_tokens + 3) / 4);
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(NumThreads(), work / kMinWorkPerThread)));
}

// One product of RunQuantProducts: y [n_tokens][y_stride] = x · wᵀ.
struct QuantOut {
  GgmlType type;  // IsIntegerDotType(type)
  const uint8_t* w;
  const uint8_t* wi;  // as QuantJob's
  int64_t rows;
  int64_t row_bytes;
  float* y;
  int64_t y_stride;
};

// Where RunQuantProducts' quantised activations lie: the rows layout (aq:
// [n_tokens][cols] int8, ad/as: [n_tokens][nb] f32, ai: [n_tokens][nb][2]
// int32) and the tiles layout (QuantJob::aqt..ait), each null when not made;
// ot: QuantJob::aot of each tile offset of the call, one after another.
struct QuantActs {
  int8_t *q = nullptr, *qt = nullptr;
  float *d = nullptr, *s = nullptr, *dt = nullptr, *st = nullptr;
  int32_t *i = nullptr, *it = nullptr, *ot = nullptr;
};

// Products of the same activations x [n_tokens][x_stride] (cols used) with
// integer-dot weights: x is quantised once per thread or once for all, and one
// parallel loop covers every product's rows (in parts of RowsOfNextPart), so
// that the q/k/v or gate/up projections of a layer cost one loop, not three or
// two.
void RunQuantProducts(const Kernels& k, absl::Span<const QuantOut> outs, const float* x, int64_t x_stride,
                      int64_t cols, int n_tokens, int n_threads) {
  ComputePool& pool = ComputePool::Get();
  // Two layouts of the quantised activations, each made only when a kernel of the
  // call reads it: rows for stored-layout rows (no interleaved copy, or the rows
  // % 16 after its groups), and tiles for the interleaved groups. Tiles of one
  // token (one token, or the scalar level's width of 1) are rows: then the two
  // share the row buffers.
  const int64_t nb = cols / 32;
  const bool rows_are_tiles = n_tokens == 1 || k.tile_tokens == 1;
  const bool any_tiles =
      std::any_of(outs.begin(), outs.end(), [](const QuantOut& o) { return o.wi != nullptr; });
  const bool any_rows = std::any_of(outs.begin(), outs.end(), [](const QuantOut& o) {
    return o.wi == nullptr || o.rows % kInterleaveRows != 0;
  });
  const bool make_rows = rows_are_tiles || any_rows;
  const bool make_tiles = !rows_are_tiles && any_tiles;
  const int64_t layouts = (make_rows ? 1 : 0) + (make_tiles ? 1 : 0);
  const int64_t values = int64_t{n_tokens} * cols * layouts;
  // The distinct tile offsets of the call's products (QuantJob::aot), and which
  // of them each product's tiles read (-1: none).
  absl::InlinedVector<int32_t, 2> offsets;
  absl::InlinedVector<int, 3> offset_of;
  for (const QuantOut& o : outs) {
    const int32_t off = o.wi != nullptr ? k.tile_offset(o.type) : 0;
    auto it = std::find(offsets.begin(), offsets.end(), off);
    if (off != 0 && it == offsets.end()) it = offsets.insert(offsets.end(), off);
    offset_of.push_back(off != 0 ? static_cast<int>(it - offsets.begin()) : -1);
  }
  const int64_t per_layout = int64_t{n_tokens} * nb;
  // The calling thread's buffers, grown to this call's layouts (inside a loop
  // this names the running thread's own).
  auto this_threads_buffers = [&] {
    thread_local std::vector<int8_t> aq;
    thread_local std::vector<int32_t> ai;
    std::vector<float>& ads = ThreadScratch(1);
    aq.resize(static_cast<size_t>(values));
    ai.resize(static_cast<size_t>((layouts * 2 + static_cast<int64_t>(offsets.size()) * 3) * per_layout));
    ads.resize(static_cast<size_t>(layouts * 2 * per_layout));
    QuantActs a;
    int64_t layout = 0;
    if (make_rows) {
      a.q = aq.data(), a.i = ai.data(), a.d = ads.data(), a.s = ads.data() + per_layout;
      ++layout;
    }
    if (make_tiles) {
      a.qt = aq.data() + layout * per_layout * 32, a.it = ai.data() + layout * per_layout * 2;
      a.dt = ads.data() + layout * 2 * per_layout, a.st = a.dt + per_layout;
    } else if (rows_are_tiles) {
      a.qt = a.q, a.it = a.i, a.dt = a.d, a.st = a.s;
    }
    if (!offsets.empty()) a.ot = ai.data() + layouts * 2 * per_layout;
    return a;
  };
  // Token tile i of each layout made: a token's row alone is a fraction of a
  // microsecond of work, less than the pool's claim of an index. Each layout is
  // quantised from x directly (the same values: one function, one stride each).
  absl::InlinedVector<int, 64> tile_t0;
  for (int t0 = 0; t0 < n_tokens; t0 += TileTokens(n_tokens, t0, k.tile_tokens)) tile_t0.push_back(t0);
  auto quantize_tile = [&](const QuantActs& a, int64_t i) {
    const int t0 = tile_t0[i], n = TileTokens(n_tokens, t0, k.tile_tokens);
    for (int t = t0; t < t0 + n; ++t) {
      const float* xt = x + t * x_stride;
      if (make_rows)
        k.quantize_row(xt, cols, a.q + t * cols, a.d + t * nb, a.s + t * nb, a.i + t * 2 * nb, 1);
      if (make_tiles) {
        const int64_t at = t0 * nb + (t - t0);  // block 0 of token t in tile t0 (QuantJob::aqt)
        k.quantize_row(xt, cols, a.qt + at * 32, a.dt + at, a.st + at, a.it + at * 2, n);
      }
    }
    // The tile's entries of each offset's start values, in the tiles' order.
    for (int64_t j = 0; j < static_cast<int64_t>(offsets.size()); ++j) {
      const int32_t o = offsets[j];
      for (int64_t e = t0 * nb; e < (t0 + n) * nb; ++e) {
        const int32_t lo = a.it[2 * e], hi = a.it[2 * e + 1];
        int32_t* start = a.ot + (j * per_layout + e) * 3;
        start[0] = -o * lo, start[1] = -o * hi, start[2] = -o * (lo + hi);
      }
    }
  };
  struct Part {
    int job;
    int64_t r0, r1;
  };
  absl::InlinedVector<QuantJob, 3> jobs;
  absl::InlinedVector<Part, 64> parts;
  int64_t rows_left = 0;
  for (const QuantOut& o : outs) rows_left += o.rows;
  for (const QuantOut& o : outs) {
    jobs.push_back(QuantJob{o.type, o.w, o.wi, o.rows, o.row_bytes, nb, n_tokens, nullptr, nullptr, nullptr,
                            nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, o.y, o.y_stride});
    for (int64_t r0 = 0; r0 < o.rows;) {
      const int64_t r1 = std::min(o.rows, r0 + RowsOfNextPart(rows_left, n_threads));
      parts.push_back(Part{static_cast<int>(jobs.size()) - 1, r0, r1});
      rows_left -= r1 - r0;
      r0 = r1;
    }
  }
  auto run_part = [&](const QuantActs& a, int64_t i) {
    QuantJob job = jobs[parts[i].job];
    job.aq = a.q, job.ad = a.d, job.as = a.s, job.ai = a.i;
    job.aqt = a.qt, job.adt = a.dt, job.ast = a.st, job.ait = a.it;
    if (const int j = offset_of[parts[i].job]; j >= 0) job.aot = a.ot + j * per_layout * 3;
    k.quant_rows(job, parts[i].r0, parts[i].r1);
  };
  if (n_threads > 1 && values <= kMaxPerThreadQuantValues) {
    // Each thread quantises every token into its own buffers on its first part,
    // with no wait on another thread's quantisation.
    static std::atomic<uint64_t> next_call{1};
    const uint64_t call = next_call.fetch_add(1, std::memory_order_relaxed);
    pool.ParallelFor(static_cast<int64_t>(parts.size()), n_threads, [&](int64_t i) {
      thread_local uint64_t quantised_for = 0;
      thread_local QuantActs mine;
      if (quantised_for != call) {
        mine = this_threads_buffers();
        for (int64_t j = 0; j < static_cast<int64_t>(tile_t0.size()); ++j) quantize_tile(mine, j);
        quantised_for = call;
      }
      run_part(mine, i);
    });
    return;
  }
  const QuantActs shared = this_threads_buffers();
  pool.ParallelFor(static_cast<int64_t>(tile_t0.size()), n_threads,
                   [&](int64_t i) { quantize_tile(shared, i); });
  pool.ParallelFor(static_cast<int64_t>(parts.size()), n_threads, [&](int64_t i) { run_part(shared, i); });
}

void SetOpenBlasSingleThreaded() {
  // Each pool thread calls sgemm on its own tile; OpenBLAS must not fan out again.
  // Checked per call: other code (a benchmark baseline) may have raised it.
  if (openblas_get_num_threads() != 1) openblas_set_num_threads(1);
}

}  // namespace

bool IsIntegerDotType(GgmlType type) {
  switch (type) {
    case GgmlType::kQ4_0:
    case GgmlType::kQ4_1:
    case GgmlType::kQ5_0:
    case GgmlType::kQ8_0:
    case GgmlType::kQ4_K:
    case GgmlType::kQ5_K:
    case GgmlType::kQ6_K:
      return true;
    default:
      return false;
  }
}

MatMulTokenShape CurrentMatMulTokenShape(GgmlType type) {
  if (!IsIntegerDotType(type)) return {};
  switch (GetCpuKernelLevel()) {
    case CpuKernelLevel::kAvx512:
      return {avx512::kTileTokens, avx512::UnpackMinTokens(type) - 1};
    case CpuKernelLevel::kAvx2:
      return {avx2::kTileTokens, avx2::UnpackMinTokens(type) - 1};
    default:
      return {};
  }
}

int SgemmMinTokens() {
  const int set = g_sgemm_min_tokens.load(std::memory_order_relaxed);
  if (set > 0) return set;
  // The integer kernels compute each token's outputs from that token alone, so
  // a reply does not depend on how its prefill was chunked or on what shared
  // the step (PressureSoakTest compares seeded replies under different
  // concurrency). Dequant+sgemm rounds differently, so choosing the route by
  // chunk size would break that: at the vector levels prefill stays on the
  // integer kernels, and the speed this leaves is measured instead. With
  // cpu_kernels_bench prefill_types_* (2 threads, Intel Xeon) the VNNI kernel
  // wins up to 64 tokens and a 512-token prefill through sgemm ran 25% (Q4_1)
  // to 50% (Q4_K_M) faster (engine_bench --sgemm_min_tokens=256). The AVX2
  // 8-row group kernels beat sgemm at every count for every 4-6 bit type
  // (AMD EPYC Zen 3, 2 threads, medians of 3: 1.4-1.8x at 256 tokens, 2.5-3.0x
  // at 16); Q8_0 is 1.14x at 16 and 0.79x at 256.
  // Scalar dots always lose to OpenBLAS, and the scalar level always uses it.
  switch (GetCpuKernelLevel()) {
    case CpuKernelLevel::kAvx512:
    case CpuKernelLevel::kAvx2:
      return INT_MAX;
    default:
      return 1;
  }
}
void SetSgemmMinTokens(int n_tokens) {
  g_sgemm_min_tokens.store(std::max(0, n_tokens), std::memory_order_relaxed);
}

ScopedSgemmMinTokens::ScopedSgemmMinTokens(int n_tokens)
    : saved_(g_sgemm_min_tokens.load(std::memory_order_relaxed)) {
  SetSgemmMinTokens(n_tokens);
}
ScopedSgemmMinTokens::~ScopedSgemmMinTokens() { SetSgemmMinTokens(saved_); }

void QuantizeActivationsQ8(const float* x, int64_t x_stride, int n_tokens, int64_t cols, int8_t* q, float* d,
                           float* s) {
  const Kernels& k = KernelsFor(GetCpuKernelLevel());
  const int64_t nb = cols / 32;
  for (int t = 0; t < n_tokens; ++t) {
    k.quantize_row(x + t * x_stride, cols, q + t * cols, d + t * nb, s + t * nb, nullptr, 1);
  }
}

namespace {

// What every InterleaveRows16 layout shares: a row is a run of units (a 32-value
// block, or a k-quant super-block of 256) of unit_bytes each; the 16 rows' unit u
// of a group become group_unit_bytes of the result, written by
// place(dst, unit, r) for each row r. Groups go over the compute pool.
template <class Place>
std::vector<uint8_t> InterleaveUnits(const WeightView& w, int64_t unit_values, int64_t unit_bytes,
                                     int64_t group_unit_bytes, Place place) {
  const int64_t units = w.cols / unit_values, row_bytes = units * unit_bytes,
                groups = w.rows / kInterleaveRows;
  std::vector<uint8_t> out(static_cast<size_t>(groups * units * group_unit_bytes));
  const auto* src = static_cast<const uint8_t*>(w.data);
  ComputePool::Get().ParallelFor(groups, NumThreads(), [&](int64_t g) {
    for (int64_t u = 0; u < units; ++u) {
      uint8_t* dst = out.data() + (g * units + u) * group_unit_bytes;
      for (int r = 0; r < kInterleaveRows; ++r)
        place(dst, src + (g * kInterleaveRows + r) * row_bytes + u * unit_bytes, r);
    }
  });
  return out;
}

// Q4_K/Q5_K, per super-block of 256 values of the group's 16 rows: d[16] f16,
// dmin[16] f16, then per sub-block j its 16 rows' 6-bit scales and then mins as
// bytes (32 bytes a sub-block), then (Q5_K) the fifth bits qh in 8 steps of 4 bytes
// per row, then the quants: per pair of sub-blocks (2i, 2i + 1) 8 steps of 4 bytes
// per row (low nibbles sub-block 2i, high 2i + 1).
std::vector<uint8_t> InterleaveKRows16(const WeightView& w) {
  const bool five = w.type == GgmlType::kQ5_K;
  const int64_t block_bytes = five ? sizeof(gguf::BlockQ5_K) : sizeof(gguf::BlockQ4_K);
  static_assert(kIK4Qs + 4 * 8 * 64 == kInterleaveRows * sizeof(gguf::BlockQ4_K) + 64);
  static_assert(kIK5Qs + 4 * 8 * 64 == kInterleaveRows * sizeof(gguf::BlockQ5_K) + 64);
  const size_t qs = five ? offsetof(gguf::BlockQ5_K, qs) : offsetof(gguf::BlockQ4_K, qs);
  // 16 x 12 packed scale bytes become 16 x 16 bytes: 64 more a group super-block.
  return InterleaveUnits(
      w, 256, block_bytes, kInterleaveRows * block_bytes + 64, [&](uint8_t* dst, const uint8_t* blk, int r) {
        std::memcpy(dst + 2 * r, blk, 2);           // d
        std::memcpy(dst + 32 + 2 * r, blk + 2, 2);  // dmin
        for (int j = 0; j < 8; ++j) {
          int scale, min;
          ScaleMinK4Scalar(j, blk + 4, &scale, &min);
          dst[kIKScales + 32 * j + r] = static_cast<uint8_t>(scale);
          dst[kIKScales + 32 * j + 16 + r] = static_cast<uint8_t>(min);
        }
        if (five) {
          for (int k = 0; k < 8; ++k)
            std::memcpy(dst + kIK5Qh + 64 * k + 4 * r, blk + offsetof(gguf::BlockQ5_K, qh) + 4 * k, 4);
        }
        uint8_t* q = dst + (five ? kIK5Qs : kIK4Qs);
        for (int i = 0; i < 4; ++i) {
          for (int k = 0; k < 8; ++k) std::memcpy(q + 512 * i + 64 * k + 4 * r, blk + qs + 32 * i + 4 * k, 4);
        }
      });
}

// Q6_K, per super-block of the group's 16 rows: d[16] f16; the 16 sub-blocks'
// int8 scales of the 16 rows (16 bytes a sub-block); ql's 4 chunks of 32 bytes and
// qh's 2, each in 8 steps of 4 bytes per row. The same size.
std::vector<uint8_t> InterleaveQ6KRows16(const WeightView& w) {
  constexpr int64_t kBlock = sizeof(gguf::BlockQ6_K);
  static_assert(kIQ6Qh + 2 * 8 * 64 == kInterleaveRows * kBlock);
  return InterleaveUnits(
      w, 256, kBlock, kInterleaveRows * kBlock, [](uint8_t* dst, const uint8_t* bytes, int r) {
        const auto& blk = *reinterpret_cast<const gguf::BlockQ6_K*>(bytes);
        std::memcpy(dst + 2 * r, &blk.d, 2);
        for (int i = 0; i < 16; ++i) dst[kIQ6Scales + 16 * i + r] = static_cast<uint8_t>(blk.scales[i]);
        for (int c = 0; c < 4; ++c) {
          for (int k = 0; k < 8; ++k)
            std::memcpy(dst + kIQ6Ql + 512 * c + 64 * k + 4 * r, blk.ql + 32 * c + 4 * k, 4);
        }
        for (int c = 0; c < 2; ++c) {
          for (int k = 0; k < 8; ++k)
            std::memcpy(dst + kIQ6Qh + 512 * c + 64 * k + 4 * r, blk.qh + 32 * c + 4 * k, 4);
        }
      });
}

// Q4_0/Q4_1/Q5_0/Q8_0: a row's block is its head fields (f16 d, then Q4_1's f16 m
// or Q5_0's 32 fifth bits), then its quant bytes. A group block holds each field
// of the 16 rows side by side, in order, then the quants in 64-byte steps of 4
// bytes per row.
std::vector<uint8_t> InterleaveBlockRows16(const WeightView& w, int64_t block_bytes,
                                           absl::InlinedVector<int64_t, 2> fields) {
  int64_t head = 0;  // a row's head bytes
  for (int64_t f : fields) head += f;
  const int64_t quant_bytes = block_bytes - head;  // 16 or 32
  return InterleaveUnits(w, 32, block_bytes, kInterleaveRows * block_bytes,
                         [&](uint8_t* dst, const uint8_t* blk, int r) {
                           int64_t at = 0, from = 0;  // the field's region in dst, its offset in blk
                           for (int64_t f : fields) {
                             std::memcpy(dst + at + f * r, blk + from, static_cast<size_t>(f));
                             at += f * kInterleaveRows;
                             from += f;
                           }
                           for (int64_t j = 0; j < quant_bytes / 4; ++j)
                             std::memcpy(dst + at + 64 * j + 4 * r, blk + head + 4 * j, 4);
                         });
}

}  // namespace

std::vector<uint8_t> InterleaveRows16(const WeightView& w) {
  if (w.data == nullptr || w.rows < kInterleaveRows || w.cols <= 0 || w.cols % 32 != 0) return {};
  switch (w.type) {
    case GgmlType::kQ4_0:
      return InterleaveBlockRows16(w, sizeof(gguf::BlockQ4_0), {2});
    case GgmlType::kQ4_1:
      return InterleaveBlockRows16(w, sizeof(gguf::BlockQ4_1), {2, 2});
    case GgmlType::kQ5_0:
      return InterleaveBlockRows16(w, sizeof(gguf::BlockQ5_0), {2, 4});
    case GgmlType::kQ8_0:
      return InterleaveBlockRows16(w, sizeof(gguf::BlockQ8_0), {2});
    case GgmlType::kQ4_K:
    case GgmlType::kQ5_K:
      return w.cols % 256 == 0 ? InterleaveKRows16(w) : std::vector<uint8_t>{};
    case GgmlType::kQ6_K:
      return w.cols % 256 == 0 ? InterleaveQ6KRows16(w) : std::vector<uint8_t>{};
    default:
      return {};
  }
}

absl::Status MatMul(const KernelWeight& kw, const float* x, int64_t x_stride, int n_tokens, float* y,
                    int64_t y_stride, MatMulPath path) {
  const WeightView& w = kw.view;
  const gguf::GgmlTypeTraits* traits = gguf::GetTypeTraits(static_cast<uint32_t>(w.type));
  if (traits == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("MatMul: unknown weight type ", static_cast<uint32_t>(w.type)));
  }
  if (!traits->supported) {
    return absl::UnimplementedError(absl::StrCat("MatMul: weight type ", traits->name, " cannot be decoded"));
  }
  if (w.rows < 0 || w.cols < 0 || n_tokens < 0 || x_stride < w.cols || y_stride < w.rows) {
    return absl::InvalidArgumentError(absl::StrCat("MatMul: bad shape rows=", w.rows, " cols=", w.cols,
                                                   " n_tokens=", n_tokens, " x_stride=", x_stride,
                                                   " y_stride=", y_stride));
  }
  absl::StatusOr<int64_t> row_bytes = gguf::RowBytes(w.type, w.cols);
  if (!row_bytes.ok()) return row_bytes.status();
  if (n_tokens == 0 || w.rows == 0) return absl::OkStatus();
  if (w.data == nullptr || x == nullptr || y == nullptr) {
    return absl::InvalidArgumentError("MatMul: null pointer");
  }
  if (w.cols == 0) {
    for (int t = 0; t < n_tokens; ++t) std::fill(y + t * y_stride, y + t * y_stride + w.rows, 0.f);
    return absl::OkStatus();
  }

  const Kernels& k = KernelsFor(GetCpuKernelLevel());
  const int n_threads = ThreadsFor(w.rows * *row_bytes, n_tokens);
  const auto* wbytes = static_cast<const uint8_t*>(w.data);
  const int64_t rows = w.rows, cols = w.cols;
  const bool sgemm =
      path == MatMulPath::kSgemm || (path == MatMulPath::kAuto && n_tokens >= SgemmMinTokens());
  const bool quant = IsIntegerDotType(w.type);
  ComputePool& pool = ComputePool::Get();

  std::atomic<bool> failed{false};
  absl::Status first_error;
  std::mutex error_mu;
  auto record = [&](absl::Status st) {
    if (st.ok()) return;
    std::lock_guard<std::mutex> lock(error_mu);
    if (!failed.exchange(true)) first_error = std::move(st);
  };

  if (sgemm) {
    SetOpenBlasSingleThreaded();
    const int64_t n_tiles = (rows + kSgemmRowTile - 1) / kSgemmRowTile;
    pool.ParallelFor(n_tiles, n_threads, [&](int64_t tile) {
      const int64_t r0 = tile * kSgemmRowTile;
      const int64_t nr = std::min(kSgemmRowTile, rows - r0);
      const float* wt;  // wt: [nr][cols] f32
      if (w.type == GgmlType::kF32) {
        wt = reinterpret_cast<const float*>(wbytes + r0 * *row_bytes);
      } else {
        std::vector<float>& buf = ThreadScratch(0);
        buf.resize(static_cast<size_t>(kSgemmRowTile * cols));
        for (int64_t r = 0; r < nr && !failed.load(std::memory_order_relaxed); ++r) {
          record(DequantRow(k, w.type, wbytes + (r0 + r) * *row_bytes, buf.data() + r * cols, cols));
        }
        wt = buf.data();
      }
      if (!failed.load(std::memory_order_relaxed)) {
        // y[:, r0:r0+nr] = x [n_tokens][cols] · wtᵀ [cols][nr]
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n_tokens, static_cast<int>(nr),
                    static_cast<int>(cols), 1.0f, x, static_cast<int>(x_stride), wt, static_cast<int>(cols),
                    0.0f, y + r0, static_cast<int>(y_stride));
      }
    });
    return failed.load() ? first_error : absl::OkStatus();
  }

  const int64_t n_chunks = (rows + kDotRowChunk - 1) / kDotRowChunk;
  if (quant) {
    const QuantOut out{w.type, wbytes, kw.interleaved, rows, *row_bytes, y, y_stride};
    RunQuantProducts(k, {&out, 1}, x, x_stride, cols, n_tokens, n_threads);
    return absl::OkStatus();
  }

  if (w.type == GgmlType::kF32) {
    const auto* wf = reinterpret_cast<const float*>(wbytes);
    pool.ParallelFor(n_chunks, n_threads, [&](int64_t c) {
      const int64_t r0 = c * kDotRowChunk;
      k.f32_rows(wf + r0 * cols, cols, std::min(kDotRowChunk, rows - r0), cols, x, x_stride, n_tokens, y,
                 y_stride, r0);
    });
    return absl::OkStatus();
  }

  // Generic: dequantise a chunk of rows to f32, then the f32 kernel.
  pool.ParallelFor(n_chunks, n_threads, [&](int64_t c) {
    const int64_t r0 = c * kDotRowChunk;
    const int64_t nr = std::min(kDotRowChunk, rows - r0);
    std::vector<float>& buf = ThreadScratch(0);
    buf.resize(static_cast<size_t>(kDotRowChunk * cols));
    bool ok = true;
    for (int64_t r = 0; r < nr && ok; ++r) {
      absl::Status st = DequantRow(k, w.type, wbytes + (r0 + r) * *row_bytes, buf.data() + r * cols, cols);
      ok = st.ok();
      record(std::move(st));
    }
    if (ok) k.f32_rows(buf.data(), cols, nr, cols, x, x_stride, n_tokens, y, y_stride, r0);
  });
  return failed.load() ? first_error : absl::OkStatus();
}

absl::Status MatMulSameInput(absl::Span<const MatMulOutput> outs, const float* x, int n_tokens) {
  if (outs.empty()) return absl::OkStatus();
  const int64_t cols = outs[0].w.view.cols;
  bool fused = n_tokens > 0 && n_tokens < SgemmMinTokens() && cols > 0 && x != nullptr;
  int64_t weight_bytes = 0;
  absl::InlinedVector<QuantOut, 3> qouts;
  for (const MatMulOutput& o : outs) {
    if (o.w.view.cols != cols) {
      return absl::InvalidArgumentError(
          absl::StrCat("MatMulSameInput: cols ", o.w.view.cols, " differ from the first product's ", cols));
    }
  }
  for (const MatMulOutput& o : outs) {
    const WeightView& w = o.w.view;
    const absl::StatusOr<int64_t> row_bytes = gguf::RowBytes(w.type, w.cols);
    fused = fused && IsIntegerDotType(w.type) && row_bytes.ok() && w.rows > 0 && w.data != nullptr &&
            o.y != nullptr;
    if (!fused) break;
    weight_bytes += w.rows * *row_bytes;
    qouts.push_back(QuantOut{w.type, static_cast<const uint8_t*>(w.data), o.w.interleaved, w.rows, *row_bytes,
                             o.y, w.rows});
  }
  if (!fused) {
    // The general route, with MatMul's own checks and errors.
    for (const MatMulOutput& o : outs) KVCACHE_RETURN_IF_ERROR(MatMul(o.w, x, n_tokens, o.y));
    return absl::OkStatus();
  }
  RunQuantProducts(KernelsFor(GetCpuKernelLevel()), qouts, x, cols, cols, n_tokens,
                   ThreadsFor(weight_bytes, n_tokens));
  return absl::OkStatus();
}

}  // namespace kvcache::cpu
