#include "worker/backend/cpu/attention.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/gguf/fp16.h"
#include "worker/backend/cpu/compute_pool.h"
#include "worker/backend/cpu/cpu_features.h"
#include "worker/backend/cpu/simd_math.h"

namespace kvcache::cpu {
namespace {

// Query rows (query tokens x heads of one group) per work item: Q, O and the
// converted K/V chunk then stay in L1 (32 x 128 x 4 B = 16 KiB each at most).
constexpr int kMaxItemRows = 32;
// Keys per part of a split key range (rounded up to whole pages). The parts
// lie at fixed key positions, multiples of this, so that a query row's output
// depends on its own keys alone: not on the batch, the query block, the number
// of threads or the step's cost, all of which used to set the split (a greedy
// reply then changed with what else the worker ran, and an APPEND conversation
// differed from the same tokens sent as one FULL_CONTEXT request past ~500
// tokens, where decode steps had split and prefill had not).
constexpr int kSplitKeys = 512;

// ---- Scalar inner loops (the reference path) ----

// dst[j][0..width) = f32(src + j * src_stride bytes), j < n.
void ToF32Scalar(const uint8_t* src, int64_t src_stride, KvDtype dtype, int n, int width, float* dst) {
  for (int j = 0; j < n; ++j) {
    const uint8_t* row = src + j * src_stride;
    float* d = dst + static_cast<int64_t>(j) * width;
    for (int i = 0; i < width; ++i) {
      uint16_t h;
      switch (dtype) {
        case KvDtype::kF32:
          std::memcpy(&d[i], row + 4 * i, 4);
          break;
        case KvDtype::kF16:
          std::memcpy(&h, row + 2 * i, 2);
          d[i] = gguf::Fp16ToFp32(h);
          break;
        case KvDtype::kBF16:
          std::memcpy(&h, row + 2 * i, 2);
          d[i] = gguf::Bf16ToFp32(h);
          break;
      }
    }
  }
}

// s[j] = q · kf[j * ld .. + hd), j < n.  q: [hd].
void ScoresScalar(const float* q, const float* kf, int64_t ld, int n, int hd, float* s) {
  for (int j = 0; j < n; ++j) {
    float sum = 0.0f;
    for (int i = 0; i < hd; ++i) sum += q[i] * kf[j * ld + i];
    s[j] = sum;
  }
}

// s[j] = e^(s[j] - m) for j < n; returns the sum.
float ExpSumScalar(float* s, int n, float m) {
  float sum = 0.0f;
  for (int j = 0; j < n; ++j) {
    s[j] = std::exp(s[j] - m);
    sum += s[j];
  }
  return sum;
}

// o[0..hd) = o * corr + sum_j p[j] * vf[j * ld .. + hd).
void PvScalar(float* o, const float* p, const float* vf, int64_t ld, int n, int hd, float corr) {
  for (int i = 0; i < hd; ++i) {
    float acc = o[i] * corr;
    for (int j = 0; j < n; ++j) acc += p[j] * vf[j * ld + i];
    o[i] = acc;
  }
}

// n % 8 == 0 floats -> f16, round to nearest even (same as gguf::Fp32ToFp16).
KVCACHE_TARGET_AVX2 void F32ToF16Avx2(const float* src, uint8_t* dst, int64_t n) {
  for (int64_t j = 0; j < n; j += 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 2 * j),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + j), _MM_FROUND_TO_NEAREST_INT));
  }
}

// Requests `bytes` at p into L2 (T1), one prefetch per 64-byte line. The block
// paths prefetch the next page's rows this way: into L1 (T0) each prefetch holds
// a fill buffer until its line arrives, and the current block's loads waited
// for them (13-15 against 20-27 GB/s of K/V on two Zen 4 cores). One page ahead
// is the distance: on two Zen 3 cores (avx2, SmolLM2's decode shape, 4k keys,
// all layers from DRAM, 12 rounds alternating) two and four pages ahead took 5%
// and 12% longer (medians of the paired ratios).
inline void PrefetchL2(const uint8_t* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(reinterpret_cast<const char*>(p + b), _MM_HINT_T1);
}

// The block paths' dispatch tables are indexed by these values.
static_assert(static_cast<int>(KvDtype::kF32) == 0 && static_cast<int>(KvDtype::kF16) == 1 &&
              static_cast<int>(KvDtype::kBF16) == 2);

// ---- Work decomposition ----

// Query rows (tokens [q0, q1) x the query heads of kv heads [h0, h1)) of one
// sequence against keys [k0, k1). Row r is token q0 + r / HG, query head
// h0 * group + r % HG, with HG = (h1 - h0) * group.
struct Item {
  int seq;
  int h0, h1;    // kv heads
  int q0, q1;    // query tokens of the sequence (0 = its first query token)
  int k0, k1;    // key positions
  int part;      // -1: writes `out` directly; else index of its partial state
  int64_t cost;  // ~ rows x keys
};

// An (h0, h1, q0, q1) unit of a sequence whose key range was split into parts.
struct SplitGroup {
  Item unit;  // k0/k1/part unused
  int first_part, n_parts;
};

struct Ctx {
  const AttentionParams* p;
  const AttentionSeq* seqs;
  const int64_t* q_row0;       // [n_seqs] first row of each sequence in q/out
  const float* q;              // [rows][n_heads][hd]
  float* out;                  // [rows][n_heads][hd]
  const int64_t* part_offset;  // [n_parts] float offset of each part in `partials`
  float* partials;             // per part: m[rows], l[rows], o[rows][hd]
  int group;
  int hd;
  float scale;
};

// Requests the K and V rows of the item's first page (its heads' bytes of each
// row): the block loops request each next page while they compute on one, but
// the first is otherwise read cold, row after row. A decode step of many short
// sessions is mostly first pages (16 SmolLM2 sessions at 16-80 tokens: 1-5 pages
// each): there attention took 0.080-0.084 of the products' time in the engine's
// 16-decode steps, against 0.089-0.096 without (engine_bench --sections=batched,
// engine_attention_ms_16_decodes / engine_products_ms_16_decodes, 7 runs each
// alternating, AMD EPYC Zen 3, avx2); a 4k-token decode (--sections=attention)
// did not change beyond the noise (5.59-6.61 against 5.50-6.34 ms, 3 runs each).
// Every path takes it (not measured at avx512: that machine had no AVX-512).
void PrefetchFirstPage(const Ctx& c, const Item& it) {
  const AttentionParams& p = *c.p;
  const PageLayout& L = p.layout;
  const int pt = L.page_tokens;
  const int slot0 = it.k0 % pt, slot1 = std::min(pt, slot0 + (it.k1 - it.k0));
  const uint8_t* page = L.page(p.kv_base, c.seqs[it.seq].page_table[it.k0 / pt]);
  const int64_t head_off = int64_t{it.h0} * c.hd * L.elt_bytes();
  const int64_t bytes = int64_t{it.h1 - it.h0} * c.hd * L.elt_bytes();
  for (int slot = slot0; slot < slot1; ++slot) {
    PrefetchL2(page + L.k_offset(p.layer, slot) + head_off, bytes);
    PrefetchL2(page + L.v_offset(p.layer, slot) + head_off, bytes);
  }
}

int FirstVisible(const AttentionParams& p, int pos) {
  return p.sliding_window > 0 ? std::max(0, pos - p.sliding_window + 1) : 0;
}

int ItemRows(const Item& it, int group) { return (it.q1 - it.q0) * (it.h1 - it.h0) * group; }

// Offset of row r's q/out vector: [rows][n_heads][hd].
int64_t RowOffset(const Ctx& c, const Item& it, int r) {
  const int hg = (it.h1 - it.h0) * c.group;
  const int i = it.q0 + r / hg;
  const int h = it.h0 * c.group + r % hg;
  return ((c.q_row0[it.seq] + i) * c.p->n_heads + h) * c.hd;
}

// Per-row state of an item: the scaled query, the running output, max and sum
// of the online softmax, and the visible key positions [lo, hi].
struct RowState {
  float* Q;     // [kMaxItemRows][hd]
  float* O;     // [kMaxItemRows][hd]
  float* M;     // [kMaxItemRows]
  float* Lsum;  // [kMaxItemRows]
  int lo[kMaxItemRows], hi[kMaxItemRows];
};

// Lays out Q, O, M, Lsum at the start of `scratch` and initialises them;
// returns the first float after them.
float* InitRows(const Ctx& c, const Item& it, float* scratch, RowState* rs) {
  const AttentionSeq& seq = c.seqs[it.seq];
  const int hd = c.hd;
  const int hg = (it.h1 - it.h0) * c.group;
  const int first_q_pos = seq.n_cached - seq.n_query;
  rs->Q = scratch;
  rs->O = rs->Q + kMaxItemRows * hd;
  rs->M = rs->O + kMaxItemRows * hd;
  rs->Lsum = rs->M + kMaxItemRows;
  for (int r = 0; r < ItemRows(it, c.group); ++r) {
    const float* qr = c.q + RowOffset(c, it, r);  // [hd]
    for (int d = 0; d < hd; ++d) rs->Q[r * hd + d] = qr[d] * c.scale;
    std::fill(rs->O + r * hd, rs->O + (r + 1) * hd, 0.0f);
    rs->M[r] = -INFINITY;
    rs->Lsum[r] = 0.0f;
    rs->hi[r] = first_q_pos + it.q0 + r / hg;
    rs->lo[r] = FirstVisible(*c.p, rs->hi[r]);
  }
  return rs->Lsum + kMaxItemRows;
}

// Writes the normalised rows to `out`, or the raw state to the item's partial.
void FinishRows(const Ctx& c, const Item& it, const RowState& rs) {
  const int hd = c.hd;
  const int n_rows = ItemRows(it, c.group);
  if (it.part < 0) {
    for (int r = 0; r < n_rows; ++r) {
      float* orow = c.out + RowOffset(c, it, r);  // [hd]
      const float inv = rs.Lsum[r] > 0.0f ? 1.0f / rs.Lsum[r] : 0.0f;
      for (int d = 0; d < hd; ++d) orow[d] = rs.O[r * hd + d] * inv;
    }
  } else {
    float* dst = c.partials + c.part_offset[it.part];  // m[n_rows] | l[n_rows] | o[n_rows][hd]
    std::copy(rs.M, rs.M + n_rows, dst);
    std::copy(rs.Lsum, rs.Lsum + n_rows, dst + n_rows);
    std::copy(rs.O, rs.O + static_cast<int64_t>(n_rows) * hd, dst + 2 * n_rows);
  }
}

// The reference item loop (any head_dim): converts a page's K/V of the item's
// kv heads, then per row scores, online softmax and P·V.
void RunItemScalar(const Ctx& c, const Item& it, float* scratch) {
  const AttentionParams& p = *c.p;
  const AttentionSeq& seq = c.seqs[it.seq];
  const PageLayout& L = p.layout;
  const int hd = c.hd, G = c.group, pt = L.page_tokens;
  const int hg = (it.h1 - it.h0) * G;
  const int width = (it.h1 - it.h0) * hd;  // converted floats per key
  const int n_rows = ItemRows(it, G);
  RowState rs;
  // scratch after the rows: Kf, Vf [pt][width] | S [pt]
  float* Kf = InitRows(c, it, scratch, &rs);
  float* Vf = Kf + static_cast<int64_t>(pt) * width;
  float* S = Vf + static_cast<int64_t>(pt) * width;
  float *Q = rs.Q, *O = rs.O, *M = rs.M, *Lsum = rs.Lsum;
  const int *lo = rs.lo, *hi = rs.hi;

  const int64_t row_bytes = L.row_bytes();
  const int64_t head_off = static_cast<int64_t>(it.h0) * hd * L.elt_bytes();
  for (int c0 = it.k0; c0 < it.k1;) {
    const int page_idx = c0 / pt;
    const int slot0 = c0 % pt;
    const int c1 = std::min(it.k1, (page_idx + 1) * pt);
    const int n = c1 - c0;
    const uint8_t* page = L.page(p.kv_base, seq.page_table[page_idx]);
    // Kf, Vf: [n][width] = keys c0..c1-1, kv heads h0..h1-1, rows row_bytes apart.
    ToF32Scalar(page + L.k_offset(p.layer, slot0) + head_off, row_bytes, L.dtype, n, width, Kf);
    ToF32Scalar(page + L.v_offset(p.layer, slot0) + head_off, row_bytes, L.dtype, n, width, Vf);
    for (int r = 0; r < n_rows; ++r) {
      if (c1 <= lo[r] || c0 > hi[r]) continue;
      const int64_t kv_off = static_cast<int64_t>((r % hg) / G) * hd;  // this row's kv head
      ScoresScalar(Q + r * hd, Kf + kv_off, width, n, hd, S);
      float m_chunk = -INFINITY;
      if (c0 >= lo[r] && c1 - 1 <= hi[r]) {
        for (int j = 0; j < n; ++j) m_chunk = std::max(m_chunk, S[j]);
      } else {
        for (int j = 0; j < n; ++j) {
          if (c0 + j < lo[r] || c0 + j > hi[r]) S[j] = -INFINITY;
          m_chunk = std::max(m_chunk, S[j]);
        }
      }
      const float m_new = std::max(M[r], m_chunk);
      const float corr = M[r] == -INFINITY ? 0.0f : std::exp(M[r] - m_new);
      const float sum = ExpSumScalar(S, n, m_new);
      Lsum[r] = Lsum[r] * corr + sum;
      M[r] = m_new;
      PvScalar(O + r * hd, S, Vf + kv_off, width, n, hd, corr);
    }
    c0 = c1;
  }
  FinishRows(c, it, rs);
}

using RunItemFn = void (*)(const Ctx&, const Item&, float*);

// Scratch floats after the rows for a block path: Kf [block_keys][hd] |
// P, Lv [kMaxItemRows][block_keys].
constexpr int64_t BlockScratchFloats(int block_keys, int hd) {
  return int64_t{block_keys} * hd + 2 * kMaxItemRows * block_keys;
}

// ---- AVX2: blocks of 8 keys, one score per lane ----
// The AVX-512 design below on 8-lane registers: blend masks stand in for mask
// registers, and P·V goes by column chunks so that accumulators, V and a
// broadcast fit the 16 ymm registers.
namespace avx2 {

constexpr int kBlockKeys = 8;
// The shuffle tree in Scores leaves accumulator i's sum in lane kTreeKey[i] (an involution),
// so accumulating key kTreeKey[i] into accumulator i puts key j in lane j.
constexpr int kTreeKey[kBlockKeys] = {0, 2, 1, 3, 4, 6, 5, 7};

// Chunk c (8 values) of a K/V row at `row` as f32.
template <KvDtype DT>
KVCACHE_TARGET_AVX2 __m256 LoadChunk(const uint8_t* row, int c) {
  if constexpr (DT == KvDtype::kF16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * c)));
  } else if constexpr (DT == KvDtype::kBF16) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * c)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  } else {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(row) + 8 * c);
  }
}

// dst[j][0..8 NC) = f32(src + j * stride) for j < n; rows n..7 are zeroed so
// that masked keys multiply finite values. Row j < n_prefetch of `prefetch`
// (same stride) is prefetched alongside, as in avx512::LoadBlock.
template <int NC, KvDtype DT>
KVCACHE_TARGET_AVX2 void LoadBlock(const uint8_t* src, int64_t stride, int n, float* dst,
                                   const uint8_t* prefetch, int n_prefetch) {
  constexpr int64_t kRowBytes = NC * 8 * (DT == KvDtype::kF32 ? 4 : 2);
  for (int j = 0; j < n; ++j) {
    if (j < n_prefetch) PrefetchL2(prefetch + j * stride, kRowBytes);
    for (int c = 0; c < NC; ++c) _mm256_storeu_ps(dst + (j * NC + c) * 8, LoadChunk<DT>(src + j * stride, c));
  }
  for (int j = n; j < kBlockKeys; ++j) {
    for (int c = 0; c < NC; ++c) _mm256_storeu_ps(dst + (j * NC + c) * 8, _mm256_setzero_ps());
  }
}

// Lane j of the result = q · kf[j]: 8 dot products of length 8 NC, each
// accumulated in its own register and summed across lanes by a shuffle tree.
template <int NC>
KVCACHE_TARGET_AVX2 __m256 Scores(const float* q, const float* kf) {
  __m256 a[kBlockKeys];
  const __m256 q0 = _mm256_loadu_ps(q);
#pragma GCC unroll 8
  for (int i = 0; i < kBlockKeys; ++i) a[i] = _mm256_mul_ps(q0, _mm256_loadu_ps(kf + kTreeKey[i] * NC * 8));
  for (int c = 1; c < NC; ++c) {
    const __m256 qc = _mm256_loadu_ps(q + 8 * c);
#pragma GCC unroll 8
    for (int i = 0; i < kBlockKeys; ++i) {
      a[i] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(kf + (kTreeKey[i] * NC + c) * 8), a[i]);
    }
  }
  // 8 -> 4 registers across 128-bit lanes ([a.lo, b.hi] + [a.hi, b.lo]), then 4 -> 2 -> 1 within them.
  for (int i = 0; i < 4; ++i) {
    a[i] = _mm256_add_ps(_mm256_blend_ps(a[i], a[i + 4], 0xF0), _mm256_permute2f128_ps(a[i], a[i + 4], 0x21));
  }
  for (int i = 0; i < 2; ++i) {
    a[i] = _mm256_add_ps(_mm256_unpacklo_ps(a[i], a[i + 2]), _mm256_unpackhi_ps(a[i], a[i + 2]));
  }
  const __m256d x = _mm256_castps_pd(a[0]), y = _mm256_castps_pd(a[1]);
  return _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)),
                       _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
}

// Columns [col, col + 8 D) of o[r] += sum_{j<n} p[r][j] * V[j] for R rows at
// once, V read (and widened) straight from the page, so each V chunk feeds R
// independent accumulator chains. Per key it holds whichever is fewer in
// registers besides the R x D accumulators: the D widened V chunks (one
// broadcast at a time) or the R broadcast weights (one V chunk at a time); each
// accumulator sees the same operations in the same order either way. Row
// j < n_prefetch of `prefetch` (same stride, whole rows of 8 NC values) is
// prefetched alongside. p: rows 8 floats apart; o: R row pointers.
template <int NC, KvDtype DT, int D, int R>
KVCACHE_TARGET_AVX2 void PvRows(const float* p, const uint8_t* v, int64_t stride, int n, float* const* o,
                                int col, const uint8_t* prefetch, int n_prefetch) {
  constexpr int64_t kRowBytes = NC * 8 * (DT == KvDtype::kF32 ? 4 : 2);
  __m256 acc[R][D];
  for (int r = 0; r < R; ++r) {
    for (int d = 0; d < D; ++d) acc[r][d] = _mm256_loadu_ps(o[r] + col + 8 * d);
  }
  for (int j = 0; j < n; ++j) {
    const uint8_t* row = v + j * stride;
    if (j < n_prefetch) PrefetchL2(prefetch + j * stride, kRowBytes);
    if constexpr (R < D) {
      __m256 pj[R];
      for (int r = 0; r < R; ++r) pj[r] = _mm256_broadcast_ss(p + r * kBlockKeys + j);
      for (int d = 0; d < D; ++d) {
        const __m256 vj = LoadChunk<DT>(row, col / 8 + d);
        for (int r = 0; r < R; ++r) acc[r][d] = _mm256_fmadd_ps(pj[r], vj, acc[r][d]);
      }
    } else {
      __m256 vj[D];
      for (int d = 0; d < D; ++d) vj[d] = LoadChunk<DT>(row, col / 8 + d);
      for (int r = 0; r < R; ++r) {
        const __m256 pj = _mm256_broadcast_ss(p + r * kBlockKeys + j);
        for (int d = 0; d < D; ++d) acc[r][d] = _mm256_fmadd_ps(pj, vj[d], acc[r][d]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int d = 0; d < D; ++d) _mm256_storeu_ps(o[r] + col + 8 * d, acc[r][d]);
  }
}

// ---- Decode rows of one kv head (up to kFewRows): straight from the page ----
// A decode token's GQA group of G <= 3 query heads (MHA: 1; SmolLM2: 3) scores
// K and runs P·V without the block's K in scratch: each K or V chunk is widened
// once, in registers, for all the group's rows, and P·V broadcasts each key's
// weights once for all its columns. On a Zen 3 (avx2, SmolLM2's shape, 4k keys;
// a standalone loop, 150 steps a run, medians, three runs of each build
// alternating) one decode token's attention over all layers took 6.16-6.71
// against 8.05-8.75 ms from DRAM, and over one layer's K/V in cache 4.06-4.33
// against 5.48-5.94 ms (the machine was slower than in earlier runs: 5.4-6.0
// against 6.7-6.9 ms, 3.8-3.9 against 4.8-4.9, with a reduction in another
// order). Scores alone gave 12% in cache and nothing from DRAM.
constexpr int kFewRows = 3;

// s[r] lane j = q[r] · K[j] for R rows (q rows hd floats apart) and the block's
// keys j < 8 at k (rows `stride` apart); keys from nk on repeat key nk - 1, so
// that no row past the block is read (the caller masks those lanes). Two passes
// of 4 keys: 4 x R accumulators and one widened K chunk, the query chunks read
// by the FMAs. Every sum runs in Scores' order, lane by lane and then across
// lanes as its tree adds them, so a query row's scores are the same bits
// whichever path took it (a decode token here, the same token in a chunk
// there). The query chunks as memory operands and the lanes summed for 4 keys
// at a time in 256-bit registers (24 operations a row and block, against 35 on
// 128-bit halves) took SmolLM2's decode attention over one layer's K/V in cache
// (30 times, 2 threads, Zen 3, a standalone loop, 8 runs of each build
// alternating) from 4.16-5.36 to 3.62-4.38 ms (min-median; paired ratio 0.82;
// 0.93 in an earlier 10 pairs), and over all layers from DRAM by 2% (0.976,
// faster in 8 of 10 pairs).
template <int NC, KvDtype DT, int R>
KVCACHE_TARGET_AVX2 void ScoresFew(const float* q, const uint8_t* k, int64_t stride, int nk, __m256* s) {
  constexpr int hd = NC * 8;
  __m256 half[2][R];  // keys 0..3 (lanes 0, 1: keys 0, 2; lanes 4, 5: keys 1, 3), 4..7
  for (int h = 0; h < 2; ++h) {
    const uint8_t* rows[4];
    for (int i = 0; i < 4; ++i) rows[i] = k + std::min(4 * h + i, nk - 1) * stride;
    __m256 acc[R][4];
    for (int r = 0; r < R; ++r) {
      for (int i = 0; i < 4; ++i) acc[r][i] = _mm256_setzero_ps();
    }
    for (int c = 0; c < NC; ++c) {
      // The query chunks are read where the FMAs use them: as loop invariants GCC
      // copied all R x NC of them to the stack at every block.
      const float* qp = q + 8 * c;
      __asm__("" : "+r"(qp));
      for (int i = 0; i < 4; ++i) {
        const __m256 kc = LoadChunk<DT>(rows[i], c);
        for (int r = 0; r < R; ++r) acc[r][i] = _mm256_fmadd_ps(_mm256_loadu_ps(qp + r * hd), kc, acc[r][i]);
      }
    }
    // Key i's lanes v: ((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7)), as Scores'
    // tree, for 4 keys in 256-bit operations (fp addition commutes, so the bits
    // are the same whichever operand comes first).
    for (int r = 0; r < R; ++r) {
      __m256 x[2];  // [key 2i: v0+v4 .. v3+v7 | key 2i+1: the same]
      for (int i = 0; i < 2; ++i) {
        const __m256 a = acc[r][2 * i], b = acc[r][2 * i + 1];
        x[i] = _mm256_add_ps(_mm256_blend_ps(a, b, 0xF0), _mm256_permute2f128_ps(a, b, 0x21));
      }
      // [key 0: (0,2), key 2: (0,2), key 0: (1,3), key 2: (1,3) | keys 1, 3 the same]
      const __m256 y = _mm256_add_ps(_mm256_unpacklo_ps(x[0], x[1]), _mm256_unpackhi_ps(x[0], x[1]));
      half[h][r] = _mm256_add_ps(y, _mm256_shuffle_ps(y, y, 0x4E));
    }
  }
  // [keys 0, 2, 4, 6 | 1, 3, 5, 7], then in order.
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int r = 0; r < R; ++r) {
    s[r] = _mm256_permutevar8x32_ps(_mm256_shuffle_ps(half[0][r], half[1][r], 0x44), order);
  }
}

// P·V of R <= kFewRows rows over the n keys of a block, in column chunks that
// fill the registers (PvRows holding the R weights: R x D + R + 1 of them); the
// first chunk prefetches the next page's V rows.
template <int NC, KvDtype DT, int R>
KVCACHE_TARGET_AVX2 void PvFew(const float* p, const uint8_t* v, int64_t stride, int n, float* const* o,
                               const uint8_t* prefetch, int n_prefetch) {
  constexpr int D = (15 - R) / R;  // 4, 6 or 14 registers of columns
  for (int d0 = 0; d0 + D <= NC; d0 += D, n_prefetch = 0) {
    PvRows<NC, DT, D, R>(p, v, stride, n, o, 8 * d0, prefetch, n_prefetch);
  }
  if constexpr (NC % D != 0) {
    PvRows<NC, DT, NC % D, R>(p, v, stride, n, o, 8 * (NC - NC % D), prefetch, n_prefetch);
  }
}

// ScoresFew and PvFew for a run-time row count of 1..kFewRows (PvFew: 0 does nothing).
template <int NC, KvDtype DT>
KVCACHE_TARGET_AVX2 void ScoresFewRows(int rows, const float* q, const uint8_t* k, int64_t stride, int nk,
                                       __m256* s) {
  if (rows == 1) {
    ScoresFew<NC, DT, 1>(q, k, stride, nk, s);
  } else if (rows == 2) {
    ScoresFew<NC, DT, 2>(q, k, stride, nk, s);
  } else {
    ScoresFew<NC, DT, 3>(q, k, stride, nk, s);
  }
}
template <int NC, KvDtype DT>
KVCACHE_TARGET_AVX2 void PvFewRows(int rows, const float* p, const uint8_t* v, int64_t stride, int n,
                                   float* const* o, const uint8_t* prefetch, int n_prefetch) {
  if (rows == 1) {
    PvFew<NC, DT, 1>(p, v, stride, n, o, prefetch, n_prefetch);
  } else if (rows == 2) {
    PvFew<NC, DT, 2>(p, v, stride, n, o, prefetch, n_prefetch);
  } else if (rows == 3) {
    PvFew<NC, DT, 3>(p, v, stride, n, o, prefetch, n_prefetch);
  }
}

// Registers per column chunk, and rows per PvRows call: R x D accumulators,
// D V registers and a broadcast within 16 (D <= 3: 4 rows; D = 4 would leave 2).
// At 4 rows a decode token's GQA group (up to 4 query heads per kv head) reads
// and widens each V chunk once per block: SmolLM2's 3-head groups at 4k context
// went from 21.8 to 23.4-24.7 GB/s (engine_bench --sections=attention, avx2,
// two runs of each build alternating) against two passes of D = 4.
constexpr int kPvCols = 3;
template <int D>
constexpr int kPvRows = std::min(4, (15 - D) / D);

// PvRows for the last n_rows < R rows.
template <int NC, KvDtype DT, int D, int R>
KVCACHE_TARGET_AVX2 void PvTail(const float* p, const uint8_t* v, int64_t stride, int n, float* const* o,
                                int n_rows, int col, const uint8_t* prefetch, int n_prefetch) {
  if constexpr (R > 1) {
    if (n_rows == R - 1) {
      PvRows<NC, DT, D, R - 1>(p, v, stride, n, o, col, prefetch, n_prefetch);
    } else {
      PvTail<NC, DT, D, R - 1>(p, v, stride, n, o, n_rows, col, prefetch, n_prefetch);
    }
  }
}

// P·V of n_rows rows for the D registers of columns from col; prefetches in
// its first PvRows call only when asked (n_prefetch > 0).
template <int NC, KvDtype DT, int D>
KVCACHE_TARGET_AVX2 void PvCols(const float* p, const uint8_t* v, int64_t stride, int n, float* const* o,
                                int n_rows, int col, const uint8_t* prefetch, int n_prefetch) {
  constexpr int R = kPvRows<D>;
  for (; n_rows >= R; n_rows -= R, p += R * kBlockKeys, o += R, n_prefetch = 0) {
    PvRows<NC, DT, D, R>(p, v, stride, n, o, col, prefetch, n_prefetch);
  }
  PvTail<NC, DT, D, R>(p, v, stride, n, o, n_rows, col, prefetch, n_prefetch);
}

// P·V for n_rows rows over the n keys of a block; the first call prefetches
// the next page's V rows.
template <int NC, KvDtype DT>
KVCACHE_TARGET_AVX2 void Pv(const float* p, const uint8_t* v, int64_t stride, int n, float* const* o,
                            int n_rows, const uint8_t* prefetch, int n_prefetch) {
  for (int d0 = 0; d0 + kPvCols <= NC; d0 += kPvCols, n_prefetch = 0) {
    PvCols<NC, DT, kPvCols>(p, v, stride, n, o, n_rows, 8 * d0, prefetch, n_prefetch);
  }
  if constexpr (NC % kPvCols != 0) {
    PvCols<NC, DT, NC % kPvCols>(p, v, stride, n, o, n_rows, 8 * (NC - NC % kPvCols), prefetch, n_prefetch);
  }
}

// The item loop for head_dim = 8 NC and K/V of type DT, as avx512::RunItem: per
// block of up to 8 keys and kv head, K is converted once; every row of that kv
// head scores the block in one register and updates its online softmax, then
// P·V runs for the rows together, widening V as it reads it. A decode token of a
// group of up to kFewRows heads takes ScoresFew and PvFew instead.
template <int NC, KvDtype DT>
KVCACHE_TARGET_AVX2 void RunItem(const Ctx& c, const Item& it, float* scratch) {
  constexpr int hd = NC * 8;
  const AttentionParams& p = *c.p;
  const AttentionSeq& seq = c.seqs[it.seq];
  const PageLayout& L = p.layout;
  const int G = c.group, pt = L.page_tokens;
  const int hg = (it.h1 - it.h0) * G;
  const int n_tokens = it.q1 - it.q0;
  RowState rs;
  float* Kf = InitRows(c, it, scratch, &rs);  // [8][hd]
  float* P = Kf + kBlockKeys * hd;            // [kMaxItemRows][8]: a block's weights per row
  float* Lv = P + kMaxItemRows * kBlockKeys;  // [kMaxItemRows][8]: softmax sums by lane
  float* orows[kMaxItemRows];                 // output rows of P's rows
  std::fill(Lv, Lv + kMaxItemRows * kBlockKeys, 0.0f);
  const int64_t row_bytes = L.row_bytes();
  const __m256 neg_inf = _mm256_set1_ps(-INFINITY);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const bool few = n_tokens == 1 && G <= kFewRows;
  constexpr int64_t kRowBytes = NC * 8 * (DT == KvDtype::kF32 ? 4 : 2);

  for (int c0 = it.k0; c0 < it.k1;) {
    const int page_idx = c0 / pt;
    const int c1 = std::min(it.k1, (page_idx + 1) * pt);
    const uint8_t* page = L.page(p.kv_base, seq.page_table[page_idx]);
    const int next_first = (page_idx + 1) * pt;  // position of the next page's slot 0
    const uint8_t* next = next_first < it.k1 ? L.page(p.kv_base, seq.page_table[page_idx + 1]) : page;
    for (int b0 = c0; b0 < c1; b0 += kBlockKeys) {
      const int nk = std::min(kBlockKeys, c1 - b0);
      const int slot = b0 % pt;
      for (int kh = 0; kh < it.h1 - it.h0; ++kh) {
        const int64_t head_off = static_cast<int64_t>(it.h0 + kh) * hd * L.elt_bytes();
        const int n_next = std::clamp(it.k1 - (next_first + slot), 0, nk);
        int n_p = 0;
        __m256 few_s[kFewRows];  // few: the scores of rows kh * G + g
        if (few) {
          const int64_t k_off = L.k_offset(p.layer, slot) + head_off;
          ScoresFewRows<NC, DT>(G, rs.Q + kh * G * hd, page + k_off, row_bytes, nk, few_s);
          for (int j = 0; j < n_next; ++j) PrefetchL2(next + k_off + j * row_bytes, kRowBytes);
        }
        for (int t = 0; t < n_tokens; ++t) {
          for (int g = 0; g < G; ++g) {
            const int r = t * hg + kh * G + g;
            const int j_lo = std::max(0, rs.lo[r] - b0), j_hi = std::min(nk - 1, rs.hi[r] - b0);
            if (j_lo > j_hi) continue;  // no visible key in this block
            if (n_p == 0 && !few) {
              LoadBlock<NC, DT>(page + L.k_offset(p.layer, slot) + head_off, row_bytes, nk, Kf,
                                next + L.k_offset(p.layer, slot) + head_off, n_next);
            }
            // All ones in lanes j_lo..j_hi.
            const __m256 mask = _mm256_castsi256_ps(
                _mm256_andnot_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32(j_lo), lane),
                                    _mm256_cmpgt_epi32(_mm256_set1_epi32(j_hi + 1), lane)));
            const __m256 s = _mm256_blendv_ps(neg_inf, few ? few_s[g] : Scores<NC>(rs.Q + r * hd, Kf), mask);
            float* orow = rs.O + r * hd;
            float* lrow = Lv + r * kBlockKeys;
            // Masked lanes are -inf and never compare greater.
            if (_mm256_movemask_ps(_mm256_cmp_ps(s, _mm256_set1_ps(rs.M[r]), _CMP_GT_OQ)) != 0) {
              // The running max rises (rarely, after the first blocks): rescale what was summed.
              const float m_blk = simd::HMax(s);
              const __m256 cv = _mm256_set1_ps(rs.M[r] == -INFINITY ? 0.0f : std::exp(rs.M[r] - m_blk));
              rs.M[r] = m_blk;
              _mm256_storeu_ps(lrow, _mm256_mul_ps(_mm256_loadu_ps(lrow), cv));
              for (int d = 0; d < NC; ++d) {
                _mm256_storeu_ps(orow + 8 * d, _mm256_mul_ps(_mm256_loadu_ps(orow + 8 * d), cv));
              }
            }
            const __m256 e = _mm256_and_ps(mask, simd::Exp(_mm256_sub_ps(s, _mm256_set1_ps(rs.M[r]))));
            _mm256_storeu_ps(lrow, _mm256_add_ps(_mm256_loadu_ps(lrow), e));
            _mm256_storeu_ps(P + n_p * kBlockKeys, e);
            orows[n_p++] = orow;
          }
        }
        const int64_t v_off = L.v_offset(p.layer, slot) + head_off;
        if (few) {
          PvFewRows<NC, DT>(n_p, P, page + v_off, row_bytes, nk, orows, next + v_off, n_next);
        } else {
          Pv<NC, DT>(P, page + v_off, row_bytes, nk, orows, n_p, next + v_off, n_next);
        }
      }
    }
    c0 = c1;
  }
  for (int r = 0; r < ItemRows(it, G); ++r) rs.Lsum[r] = simd::HSum(_mm256_loadu_ps(Lv + r * kBlockKeys));
  FinishRows(c, it, rs);
}

// Indexed by head_dim / 8 (1..16); up to 128 as on AVX-512.
template <KvDtype DT>
constexpr RunItemFn kRunItemOf[] = {
    nullptr,         RunItem<1, DT>,  RunItem<2, DT>,  RunItem<3, DT>,  RunItem<4, DT>,  RunItem<5, DT>,
    RunItem<6, DT>,  RunItem<7, DT>,  RunItem<8, DT>,  RunItem<9, DT>,  RunItem<10, DT>, RunItem<11, DT>,
    RunItem<12, DT>, RunItem<13, DT>, RunItem<14, DT>, RunItem<15, DT>, RunItem<16, DT>};

// By KvDtype's value (kF32, kF16, kBF16), then as kRunItemOf.
constexpr const RunItemFn* kRunItem[] = {kRunItemOf<KvDtype::kF32>, kRunItemOf<KvDtype::kF16>,
                                         kRunItemOf<KvDtype::kBF16>};

}  // namespace avx2

// ---- AVX-512: blocks of 16 keys, one score per lane ----
// GCC 12's AVX-512 intrinsics pass _mm512_undefined_ps() to their builtins and
// warn -Wmaybe-uninitialized or -Wuninitialized wherever they are inlined (GCC bug 105593).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
namespace avx512 {

constexpr int kBlockKeys = 16;
// The shuffle tree in Scores leaves accumulator i's sum in lane kTreeKey[i] (an involution),
// so accumulating key kTreeKey[i] into accumulator i puts key j in lane j.
constexpr int kTreeKey[kBlockKeys] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};

// Chunk c (16 values) of a K/V row at `row` as f32.
template <KvDtype DT>
KVCACHE_TARGET_AVX512 __m512 LoadChunk(const uint8_t* row, int c) {
  if constexpr (DT == KvDtype::kF16) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * c)));
  } else if constexpr (DT == KvDtype::kBF16) {
    const __m512i w =
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * c)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  } else {
    return _mm512_loadu_ps(reinterpret_cast<const float*>(row) + 16 * c);
  }
}

// dst[j][0..16 NC) = f32(src + j * stride) for j < n; rows n..15 are zeroed so
// that masked keys multiply finite values. Row j < n_prefetch of `prefetch`
// (same stride) is prefetched alongside: the same rows of the page that comes
// next, a page of work ahead and spread over the loop (the hardware prefetcher
// does not follow the page table, and a burst of prefetches stalls the loads),
// into L2 (PrefetchL2).
template <int NC, KvDtype DT>
KVCACHE_TARGET_AVX512 void LoadBlock(const uint8_t* src, int64_t stride, int n, float* dst,
                                     const uint8_t* prefetch, int n_prefetch) {
  constexpr int64_t kRowBytes = NC * 16 * (DT == KvDtype::kF32 ? 4 : 2);
  for (int j = 0; j < n; ++j) {
    if (j < n_prefetch) PrefetchL2(prefetch + j * stride, kRowBytes);
    for (int c = 0; c < NC; ++c)
      _mm512_storeu_ps(dst + (j * NC + c) * 16, LoadChunk<DT>(src + j * stride, c));
  }
  for (int j = n; j < kBlockKeys; ++j) {
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(dst + (j * NC + c) * 16, _mm512_setzero_ps());
  }
}

// Lane j of the result = q · kf[j]: 16 dot products of length 16 NC, each
// accumulated in its own register and summed across lanes by a shuffle tree.
template <int NC>
KVCACHE_TARGET_AVX512 __m512 Scores(const float* q, const float* kf) {
  __m512 a[kBlockKeys];
  const __m512 q0 = _mm512_loadu_ps(q);
#pragma GCC unroll 16
  for (int i = 0; i < kBlockKeys; ++i) a[i] = _mm512_mul_ps(q0, _mm512_loadu_ps(kf + kTreeKey[i] * NC * 16));
  for (int c = 1; c < NC; ++c) {
    const __m512 qc = _mm512_loadu_ps(q + 16 * c);
#pragma GCC unroll 16
    for (int i = 0; i < kBlockKeys; ++i) {
      a[i] = _mm512_fmadd_ps(qc, _mm512_loadu_ps(kf + (kTreeKey[i] * NC + c) * 16), a[i]);
    }
  }
  // 16 -> 8 -> 4 registers across 128-bit lanes, then 4 -> 2 -> 1 within them.
  for (int i = 0; i < 8; ++i) {
    a[i] =
        _mm512_add_ps(_mm512_shuffle_f32x4(a[i], a[i + 8], 0x44), _mm512_shuffle_f32x4(a[i], a[i + 8], 0xEE));
  }
  for (int i = 0; i < 4; ++i) {
    a[i] =
        _mm512_add_ps(_mm512_shuffle_f32x4(a[i], a[i + 4], 0x88), _mm512_shuffle_f32x4(a[i], a[i + 4], 0xDD));
  }
  for (int i = 0; i < 2; ++i) {
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[i], a[i + 2]), _mm512_unpackhi_ps(a[i], a[i + 2]));
  }
  const __m512d x = _mm512_castps_pd(a[0]), y = _mm512_castps_pd(a[1]);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                       _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
}

// o[r] += sum_{j<n} p[r][j] * V[j] for R rows at once, V read (and widened) straight
// from the page: each V row feeds R independent accumulator chains, so converting
// it once here costs less than a round trip through scratch. Row j < n_prefetch of
// `prefetch` (same stride) is prefetched alongside. p: rows 16 floats apart; o: rows
// hd apart.
template <int NC, KvDtype DT, int R>
KVCACHE_TARGET_AVX512 void PvRows(const float* p, const uint8_t* v, int64_t stride, int n, float* const* o,
                                  const uint8_t* prefetch, int n_prefetch) {
  constexpr int64_t kRowBytes = NC * 16 * (DT == KvDtype::kF32 ? 4 : 2);
  __m512 acc[R][NC];
  for (int r = 0; r < R; ++r) {
    for (int d = 0; d < NC; ++d) acc[r][d] = _mm512_loadu_ps(o[r] + 16 * d);
  }
  for (int j = 0; j < n; ++j) {
    const uint8_t* row = v + j * stride;
    if (j < n_prefetch) PrefetchL2(prefetch + j * stride, kRowBytes);
    __m512 vj[NC];
    for (int d = 0; d < NC; ++d) vj[d] = LoadChunk<DT>(row, d);
    for (int r = 0; r < R; ++r) {
      const __m512 pj = _mm512_set1_ps(p[r * kBlockKeys + j]);
      for (int d = 0; d < NC; ++d) acc[r][d] = _mm512_fmadd_ps(pj, vj[d], acc[r][d]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int d = 0; d < NC; ++d) _mm512_storeu_ps(o[r] + 16 * d, acc[r][d]);
  }
}

// Rows per PvRows call: the R x NC accumulators take at most 16 of the 32 registers.
template <int NC>
constexpr int kPvRows = std::clamp(16 / NC, 1, 4);

// P·V for n_rows rows over the n keys of a block; the first call of a block
// also prefetches (later calls would request the same lines again).
template <int NC, KvDtype DT>
KVCACHE_TARGET_AVX512 void Pv(const float* p, const uint8_t* v, int64_t stride, int n, float* const* o,
                              int n_rows, const uint8_t* prefetch, int n_prefetch) {
  constexpr int R = kPvRows<NC>;
  for (; n_rows >= R; n_rows -= R, p += R * kBlockKeys, o += R, n_prefetch = 0) {
    PvRows<NC, DT, R>(p, v, stride, n, o, prefetch, n_prefetch);
  }
  switch (n_rows) {
    case 3:
      PvRows<NC, DT, 3>(p, v, stride, n, o, prefetch, n_prefetch);
      break;
    case 2:
      PvRows<NC, DT, 2>(p, v, stride, n, o, prefetch, n_prefetch);
      break;
    case 1:
      PvRows<NC, DT, 1>(p, v, stride, n, o, prefetch, n_prefetch);
      break;
    default:
      break;
  }
}

// The item loop for head_dim = 16 NC and K/V of type DT: per block of up to 16
// keys and kv head, K is converted once; every row of that kv head scores the
// block in one register and updates its online softmax, then P·V runs for the
// rows together, widening V as it reads it.
template <int NC, KvDtype DT>
KVCACHE_TARGET_AVX512 void RunItem(const Ctx& c, const Item& it, float* scratch) {
  constexpr int hd = NC * 16;
  const AttentionParams& p = *c.p;
  const AttentionSeq& seq = c.seqs[it.seq];
  const PageLayout& L = p.layout;
  const int G = c.group, pt = L.page_tokens;
  const int hg = (it.h1 - it.h0) * G;
  const int n_tokens = it.q1 - it.q0;
  RowState rs;
  float* Kf = InitRows(c, it, scratch, &rs);  // [16][hd]
  float* P = Kf + kBlockKeys * hd;            // [kMaxItemRows][16]: a block's weights per row
  float* Lv = P + kMaxItemRows * kBlockKeys;  // [kMaxItemRows][16]: softmax sums by lane
  float* orows[kMaxItemRows];                 // output rows of P's rows
  std::fill(Lv, Lv + kMaxItemRows * kBlockKeys, 0.0f);
  const int64_t row_bytes = L.row_bytes();
  const __m512 neg_inf = _mm512_set1_ps(-INFINITY);

  for (int c0 = it.k0; c0 < it.k1;) {
    const int page_idx = c0 / pt;
    const int c1 = std::min(it.k1, (page_idx + 1) * pt);
    const uint8_t* page = L.page(p.kv_base, seq.page_table[page_idx]);
    const int next_first = (page_idx + 1) * pt;  // position of the next page's slot 0
    const uint8_t* next = next_first < it.k1 ? L.page(p.kv_base, seq.page_table[page_idx + 1]) : page;
    for (int b0 = c0; b0 < c1; b0 += kBlockKeys) {
      const int nk = std::min(kBlockKeys, c1 - b0);
      const int slot = b0 % pt;
      for (int kh = 0; kh < it.h1 - it.h0; ++kh) {
        const int64_t head_off = static_cast<int64_t>(it.h0 + kh) * hd * L.elt_bytes();
        const int n_next = std::clamp(it.k1 - (next_first + slot), 0, nk);
        int n_p = 0;
        for (int t = 0; t < n_tokens; ++t) {
          for (int g = 0; g < G; ++g) {
            const int r = t * hg + kh * G + g;
            const int j_lo = std::max(0, rs.lo[r] - b0), j_hi = std::min(nk - 1, rs.hi[r] - b0);
            if (j_lo > j_hi) continue;  // no visible key in this block
            if (n_p == 0) {
              LoadBlock<NC, DT>(page + L.k_offset(p.layer, slot) + head_off, row_bytes, nk, Kf,
                                next + L.k_offset(p.layer, slot) + head_off, n_next);
            }
            const __mmask16 mask = static_cast<__mmask16>(((1u << (j_hi + 1)) - 1) & ~((1u << j_lo) - 1));
            const __m512 s = _mm512_mask_blend_ps(mask, neg_inf, Scores<NC>(rs.Q + r * hd, Kf));
            float* orow = rs.O + r * hd;
            float* lrow = Lv + r * kBlockKeys;
            if (_mm512_mask_cmp_ps_mask(mask, s, _mm512_set1_ps(rs.M[r]), _CMP_GT_OQ) != 0) {
              // The running max rises (rarely, after the first blocks): rescale what was summed.
              const float m_blk = simd::HMax(s);
              const __m512 cv = _mm512_set1_ps(rs.M[r] == -INFINITY ? 0.0f : std::exp(rs.M[r] - m_blk));
              rs.M[r] = m_blk;
              _mm512_storeu_ps(lrow, _mm512_mul_ps(_mm512_loadu_ps(lrow), cv));
              for (int d = 0; d < NC; ++d) {
                _mm512_storeu_ps(orow + 16 * d, _mm512_mul_ps(_mm512_loadu_ps(orow + 16 * d), cv));
              }
            }
            const __m512 e = _mm512_maskz_mov_ps(mask, simd::Exp(_mm512_sub_ps(s, _mm512_set1_ps(rs.M[r]))));
            _mm512_storeu_ps(lrow, _mm512_add_ps(_mm512_loadu_ps(lrow), e));
            _mm512_storeu_ps(P + n_p * kBlockKeys, e);
            orows[n_p++] = orow;
          }
        }
        Pv<NC, DT>(P, page + L.v_offset(p.layer, slot) + head_off, row_bytes, nk, orows, n_p,
                   next + L.v_offset(p.layer, slot) + head_off, n_next);
      }
    }
    c0 = c1;
  }
  for (int r = 0; r < ItemRows(it, G); ++r) rs.Lsum[r] = simd::HSum(_mm512_loadu_ps(Lv + r * kBlockKeys));
  FinishRows(c, it, rs);
}

// Indexed by head_dim / 16 (1..8); head_dim up to 128 keeps a row's output in registers.
template <KvDtype DT>
constexpr RunItemFn kRunItemOf[] = {nullptr,        RunItem<1, DT>, RunItem<2, DT>,
                                    RunItem<3, DT>, RunItem<4, DT>, RunItem<5, DT>,
                                    RunItem<6, DT>, RunItem<7, DT>, RunItem<8, DT>};

// By KvDtype's value (kF32, kF16, kBF16), then as kRunItemOf.
constexpr const RunItemFn* kRunItem[] = {kRunItemOf<KvDtype::kF32>, kRunItemOf<KvDtype::kF16>,
                                         kRunItemOf<KvDtype::kBF16>};

}  // namespace avx512
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

// Combines the partial softmax states of one split group into `out`.
void MergeGroup(const Ctx& c, const SplitGroup& g) {
  const int hd = c.hd;
  const int n_rows = ItemRows(g.unit, c.group);
  for (int r = 0; r < n_rows; ++r) {
    float m = -INFINITY;
    for (int s = 0; s < g.n_parts; ++s) m = std::max(m, c.partials[c.part_offset[g.first_part + s] + r]);
    float* orow = c.out + RowOffset(c, g.unit, r);  // [hd]
    std::fill(orow, orow + hd, 0.0f);
    float l = 0.0f;
    for (int s = 0; s < g.n_parts; ++s) {
      const float* part = c.partials + c.part_offset[g.first_part + s];
      const float ms = part[r];
      if (ms == -INFINITY) continue;  // this key range had no visible key for the row
      const float w = std::exp(ms - m);
      l += part[n_rows + r] * w;
      const float* o = part + 2 * n_rows + static_cast<int64_t>(r) * hd;
      for (int d = 0; d < hd; ++d) orow[d] += o[d] * w;
    }
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    for (int d = 0; d < hd; ++d) orow[d] *= inv;
  }
}

}  // namespace

absl::Status WriteKv(const PageLayout& layout, void* base, absl::Span<const int32_t> page_table, int layer,
                     int first_pos, int n_tokens, const float* k, const float* v) {
  if (layer < 0 || layer >= layout.layers || first_pos < 0 || n_tokens < 0 || layout.page_tokens <= 0 ||
      layout.kv_heads <= 0 || layout.head_dim <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("WriteKv: bad layer ", layer, " first_pos ", first_pos, " n_tokens ", n_tokens));
  }
  if (n_tokens == 0) return absl::OkStatus();
  const int64_t last_page = (static_cast<int64_t>(first_pos) + n_tokens - 1) / layout.page_tokens;
  if (last_page >= static_cast<int64_t>(page_table.size())) {
    return absl::InvalidArgumentError(absl::StrCat("WriteKv: position ", first_pos + n_tokens - 1,
                                                   " needs page ", last_page, " of a ", page_table.size(),
                                                   "-page table"));
  }
  const int64_t row = layout.row_elems();
  const bool avx2 = GetCpuKernelLevel() >= CpuKernelLevel::kAvx2;
  for (int t = 0; t < n_tokens; ++t) {
    const int pos = first_pos + t;
    uint8_t* page = layout.page(base, page_table[pos / layout.page_tokens]);
    const int slot = pos % layout.page_tokens;
    for (int which = 0; which < 2; ++which) {
      const float* src = (which == 0 ? k : v) + t * row;  // [kv_heads][head_dim]
      uint8_t* dst = page + (which == 0 ? layout.k_offset(layer, slot) : layout.v_offset(layer, slot));
      switch (layout.dtype) {
        case KvDtype::kF32:
          std::memcpy(dst, src, static_cast<size_t>(row) * 4);
          break;
        case KvDtype::kF16: {
          int64_t i = 0;
          if (avx2) {
            i = row / 8 * 8;
            F32ToF16Avx2(src, dst, i);
          }
          for (; i < row; ++i) {
            const uint16_t h = gguf::Fp32ToFp16(src[i]);
            std::memcpy(dst + 2 * i, &h, 2);
          }
          break;
        }
        case KvDtype::kBF16:
          for (int64_t i = 0; i < row; ++i) {
            const uint16_t h = gguf::Fp32ToBf16(src[i]);
            std::memcpy(dst + 2 * i, &h, 2);
          }
          break;
      }
    }
  }
  return absl::OkStatus();
}

absl::Status PagedAttention(const AttentionParams& params, absl::Span<const AttentionSeq> seqs,
                            const float* q, float* out) {
  const PageLayout& L = params.layout;
  if (L.kv_heads <= 0 || L.head_dim <= 0 || L.page_tokens <= 0 || params.n_heads <= 0 ||
      params.n_heads % L.kv_heads != 0 || params.layer < 0 || params.layer >= L.layers ||
      params.n_heads / L.kv_heads > kMaxItemRows || params.sliding_window < 0) {
    return absl::InvalidArgumentError(absl::StrCat("PagedAttention: bad shape n_heads=", params.n_heads,
                                                   " kv_heads=", L.kv_heads, " head_dim=", L.head_dim,
                                                   " layer=", params.layer, "/", L.layers));
  }
  const int G = params.n_heads / L.kv_heads;
  const int hd = L.head_dim;
  std::vector<int64_t> q_row0(seqs.size());
  int64_t rows = 0;
  for (size_t s = 0; s < seqs.size(); ++s) {
    const AttentionSeq& sq = seqs[s];
    if (sq.n_query < 0 || sq.n_cached < sq.n_query ||
        (static_cast<int64_t>(sq.n_cached) + L.page_tokens - 1) / L.page_tokens >
            static_cast<int64_t>(sq.page_table.size())) {
      return absl::InvalidArgumentError(absl::StrCat("PagedAttention: sequence ", s,
                                                     " has n_cached=", sq.n_cached, " n_query=", sq.n_query,
                                                     " and ", sq.page_table.size(), " pages"));
    }
    q_row0[s] = rows;
    rows += sq.n_query;
  }
  if (rows == 0) return absl::OkStatus();
  if (params.kv_base == nullptr || q == nullptr || out == nullptr) {
    return absl::InvalidArgumentError("PagedAttention: null pointer");
  }

  // Plan: units of (sequence, kv heads, query block), then page-aligned key splits.
  // A decode token takes all kv heads in one unit when their K/V chunk fits in
  // L1: a page's K (and V) block of the layer is then read as one contiguous run.
  const int n_threads = NumThreads();
  const int pt = L.page_tokens;
  const bool group_heads_for_decode =
      params.n_heads <= kMaxItemRows && static_cast<int64_t>(pt) * L.kv_heads * hd * 4 <= 32 * 1024;
  std::vector<Item> units;
  for (size_t s = 0; s < seqs.size(); ++s) {
    const AttentionSeq& sq = seqs[s];
    const int first_q_pos = sq.n_cached - sq.n_query;
    const int heads_per_unit = sq.n_query == 1 && group_heads_for_decode ? L.kv_heads : 1;
    const int q_block = std::max(1, kMaxItemRows / (heads_per_unit * G));
    for (int q0 = 0; q0 < sq.n_query; q0 += q_block) {
      const int q1 = std::min(sq.n_query, q0 + q_block);
      // From the start of the page: the blocks then start at the same keys
      // whichever query block or decode step reads a row (they are cut at page
      // ends), and a sliding window's keys before a row's first are masked.
      const int k0 = FirstVisible(params, first_q_pos + q0) / pt * pt;
      const int k1 = first_q_pos + q1;  // the last query token's own position + 1
      for (int h0 = 0; h0 < L.kv_heads; h0 += heads_per_unit) {
        Item u{static_cast<int>(s), h0, h0 + heads_per_unit, q0, q1, k0, k1, -1, 0};
        u.cost = static_cast<int64_t>(ItemRows(u, G)) * (k1 - k0) + 64;
        units.push_back(u);
      }
    }
  }
  // A unit whose keys reach into more than one kSplitKeys part is split at
  // those parts' bounds; the parts run as items of their own and MergeGroup
  // combines them in key order (at 4,096 keys 8 parts, so a lone long decode
  // still spreads over the threads).
  const int split_keys = (kSplitKeys + pt - 1) / pt * pt;
  std::vector<Item> items;
  std::vector<SplitGroup> groups;
  std::vector<int64_t> part_offset;
  int64_t partial_floats = 0;
  for (const Item& u : units) {
    const int first = u.k0 / split_keys, last = (u.k1 - 1) / split_keys;
    if (first == last) {
      items.push_back(u);
      continue;
    }
    const int n_rows = ItemRows(u, G);
    SplitGroup g{u, static_cast<int>(part_offset.size()), 0};
    for (int i = first; i <= last; ++i) {
      Item part = u;
      part.k0 = std::max(u.k0, i * split_keys);
      part.k1 = std::min(u.k1, (i + 1) * split_keys);
      part.part = static_cast<int>(part_offset.size());
      part.cost = static_cast<int64_t>(n_rows) * (part.k1 - part.k0) + 64;
      items.push_back(part);
      part_offset.push_back(partial_floats);
      partial_floats += static_cast<int64_t>(n_rows) * (hd + 2);
      ++g.n_parts;
    }
    groups.push_back(g);
  }
  // Longest first + dynamic scheduling balances lengths that differ a lot.
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  std::vector<float> partials(static_cast<size_t>(partial_floats));

  const Ctx ctx{&params,
                seqs.data(),
                q_row0.data(),
                q,
                out,
                part_offset.data(),
                partials.data(),
                G,
                hd,
                params.scale > 0.0f ? params.scale : 1.0f / std::sqrt(static_cast<float>(hd))};
  // The widest block path for this head_dim; the scalar reference otherwise.
  const CpuKernelLevel level = GetCpuKernelLevel();
  RunItemFn run = RunItemScalar;
  int64_t path_floats =  // the path's scratch after the rows
      2 * pt * static_cast<int64_t>(group_heads_for_decode ? L.kv_heads : 1) * hd + pt;
  if (level >= CpuKernelLevel::kAvx512 && hd % 16 == 0 && hd / 16 <= 8) {
    run = avx512::kRunItem[static_cast<int>(L.dtype)][hd / 16];
    path_floats = BlockScratchFloats(avx512::kBlockKeys, hd);
  } else if (level >= CpuKernelLevel::kAvx2 && hd % 8 == 0 && hd / 8 <= 16) {
    run = avx2::kRunItem[static_cast<int>(L.dtype)][hd / 8];
    path_floats = BlockScratchFloats(avx2::kBlockKeys, hd);
  }
  const int64_t scratch_floats = 2 * kMaxItemRows * hd + 2 * kMaxItemRows + path_floats;
  const int64_t n_items = static_cast<int64_t>(items.size());
  const int64_t n_groups = static_cast<int64_t>(groups.size());
  const int threads = static_cast<int>(std::min<int64_t>(n_threads, n_items));
  ComputePool& pool = ComputePool::Get();
  pool.ParallelFor(n_items, threads, [&](int64_t i) {
    // Cache-line aligned: rows and blocks lie at multiples of hd * 4 bytes from
    // the start, so no full-register load or store of the vector paths splits a
    // line (a 16-byte aligned scratch cost the AVX-512 path ~10%).
    thread_local std::vector<float> scratch_buf;
    if (scratch_buf.size() < static_cast<size_t>(scratch_floats) + 15)
      scratch_buf.resize(scratch_floats + 15);
    float* scratch =
        reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scratch_buf.data()) + 63) & ~uintptr_t{63});
    PrefetchFirstPage(ctx, items[i]);
    run(ctx, items[i], scratch);
  });
  pool.ParallelFor(n_groups, threads, [&](int64_t g) { MergeGroup(ctx, groups[g]); });
  return absl::OkStatus();
}

}  // namespace kvcache::cpu
