#include "worker/backend/cpu/ops.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "worker/backend/cpu/compute_pool.h"
#include "worker/backend/cpu/cpu_features.h"
#include "worker/backend/cpu/simd_math.h"

namespace kvcache::cpu {
namespace {

bool UseAvx2() { return GetCpuKernelLevel() >= CpuKernelLevel::kAvx2; }

// ---- AVX2 versions ----

KVCACHE_TARGET_AVX2 void RmsNormAvx2(const float* x, const float* w, int64_t n, float eps, float* y) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
    acc0 = _mm256_fmadd_ps(a, a, acc0);
    acc1 = _mm256_fmadd_ps(b, b, acc1);
  }
  float ss = simd::HSum(_mm256_add_ps(acc0, acc1));
  for (; i < n; ++i) ss += x[i] * x[i];
  const float scale = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  const __m256 sv = _mm256_set1_ps(scale);
  i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), sv), _mm256_loadu_ps(w + i)));
  }
  for (; i < n; ++i) y[i] = x[i] * scale * w[i];
}

KVCACHE_TARGET_AVX2 void SwiGluAvx2(const float* gate, const float* up, int64_t n, float* out) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 e = simd::Exp(_mm256_xor_ps(g, sign));  // e^-g
    const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, e));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
  }
  for (; i < n; ++i) out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

// (GCC 12 warns inside its own AVX-512 intrinsics' headers, about their
// internal undefined operands.)
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
// SwiGluAvx2 on 16 lanes: the same operations lane by lane (simd::Exp's two widths
// share their polynomial and clamps), so both levels give the same bits; the tail
// of n % 16 goes through SwiGluAvx2. SwiGLU of a 16-session SmolLM2 step 0.33 ->
// 0.27 ms (a temporary per-op timer in engine_bench --sections=batched, three
// runs alternating, Intel Xeon); the zmm division is most of what is left.
KVCACHE_TARGET_AVX512 void SwiGluAvx512(const float* gate, const float* up, int64_t n, float* out) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512i sign = _mm512_set1_epi32(static_cast<int32_t>(0x80000000u));
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 g = _mm512_loadu_ps(gate + i);
    const __m512 e = simd::Exp(  // e^-g (the sign bit flipped, as SwiGluAvx2)
        _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(g), sign)));
    const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one, e));
    _mm512_storeu_ps(out + i, _mm512_mul_ps(silu, _mm512_loadu_ps(up + i)));
  }
  SwiGluAvx2(gate + i, up + i, n - i, out + i);
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

KVCACHE_TARGET_AVX2 void AddAvx2(const float* a, const float* b, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(out + i, _mm256_add_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
  }
  for (; i < n; ++i) out[i] = a[i] + b[i];
}

KVCACHE_TARGET_AVX2 void SoftmaxAvx2(float* x, int64_t n) {
  int64_t i = 0;
  __m256 mv = _mm256_set1_ps(-INFINITY);
  for (; i + 8 <= n; i += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(x + i));
  float m = simd::HMax(mv);
  for (; i < n; ++i) m = std::max(m, x[i]);
  const __m256 mm = _mm256_set1_ps(m);
  __m256 sv = _mm256_setzero_ps();
  i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = simd::Exp(_mm256_sub_ps(_mm256_loadu_ps(x + i), mm));
    _mm256_storeu_ps(x + i, e);
    sv = _mm256_add_ps(sv, e);
  }
  float sum = simd::HSum(sv);
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - m);
    sum += x[i];
  }
  const __m256 inv = _mm256_set1_ps(1.0f / sum);
  i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), inv));
  for (; i < n; ++i) x[i] *= 1.0f / sum;
}

// x: [head_dim]; cs/sn: [head_dim] in RopeTable's duplicated/signed form.
KVCACHE_TARGET_AVX2 void RopeHeadAvx2(float* x, const float* cs, const float* sn, int head_dim) {
  int i = 0;
  for (; i + 8 <= head_dim; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256 swapped = _mm256_permute_ps(v, 0xB1);  // (x1, x0, x3, x2, ...)
    _mm256_storeu_ps(
        x + i, _mm256_fmadd_ps(v, _mm256_loadu_ps(cs + i), _mm256_mul_ps(swapped, _mm256_loadu_ps(sn + i))));
  }
  for (; i < head_dim; i += 2) {
    const float x0 = x[i], x1 = x[i + 1];
    x[i] = x0 * cs[i] + x1 * sn[i];
    x[i + 1] = x1 * cs[i + 1] + x0 * sn[i + 1];
  }
}

void RopeHeadScalar(float* x, const float* cs, const float* sn, int head_dim) {
  for (int i = 0; i < head_dim; i += 2) {
    const float x0 = x[i], x1 = x[i + 1];
    x[i] = x0 * cs[i] + x1 * sn[i];
    x[i + 1] = x1 * cs[i + 1] + x0 * sn[i + 1];
  }
}

// NeoX pairs (x[i], x[i + d/2]): a loop the compiler vectorises; RoPE is a
// small part of a step next to the matmuls.
void RopeHeadNeox(float* x, const float* cs, const float* sn, int head_dim) {
  const int half = head_dim / 2;
  for (int i = 0; i < half; ++i) {
    const float x0 = x[i], x1 = x[i + half];
    x[i] = x0 * cs[i] + x1 * sn[i];
    x[i + half] = x1 * cs[i + half] + x0 * sn[i + half];
  }
}

}  // namespace

void RmsNorm(const float* x, const float* weight, int n_tokens, int64_t n, float eps, float* y) {
  const bool avx2 = UseAvx2();
  for (int t = 0; t < n_tokens; ++t) {
    const float* xt = x + t * n;
    float* yt = y + t * n;
    if (avx2) {
      RmsNormAvx2(xt, weight, n, eps, yt);
      continue;
    }
    float ss = 0.0f;
    for (int64_t i = 0; i < n; ++i) ss += xt[i] * xt[i];
    const float scale = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
    for (int64_t i = 0; i < n; ++i) yt[i] = xt[i] * scale * weight[i];
  }
}

void SwiGlu(const float* gate, const float* up, int64_t n, float* out) {
  // Chunks of 4096 (a few microseconds of vector exp each, a multiple of the
  // vector width, so every element takes the same path as in one call): one
  // token's n_ff stays on the caller, a step of 16 sessions uses the pool.
  constexpr int64_t kChunk = 4096;
  const CpuKernelLevel level = GetCpuKernelLevel();
  auto run = [&](int64_t i0, int64_t i1) {
    if (level >= CpuKernelLevel::kAvx512) return SwiGluAvx512(gate + i0, up + i0, i1 - i0, out + i0);
    if (level >= CpuKernelLevel::kAvx2) return SwiGluAvx2(gate + i0, up + i0, i1 - i0, out + i0);
    for (int64_t i = i0; i < i1; ++i) out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
  };
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  if (chunks <= 1) return run(0, n);
  ComputePool::Get().ParallelFor(chunks, NumThreads(),
                                 [&](int64_t c) { run(c * kChunk, std::min(n, (c + 1) * kChunk)); });
}

void Add(const float* a, const float* b, int64_t n, float* out) {
  if (UseAvx2()) return AddAvx2(a, b, n, out);
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

void Softmax(float* x, int n_rows, int64_t n) {
  const bool avx2 = UseAvx2();
  for (int r = 0; r < n_rows; ++r) {
    float* row = x + r * n;
    if (avx2) {
      SoftmaxAvx2(row, n);
      continue;
    }
    float m = row[0];
    for (int64_t i = 1; i < n; ++i) m = std::max(m, row[i]);
    float sum = 0.0f;
    for (int64_t i = 0; i < n; ++i) {
      row[i] = std::exp(row[i] - m);
      sum += row[i];
    }
    for (int64_t i = 0; i < n; ++i) row[i] /= sum;
  }
}

absl::Status GetRows(const WeightView& table, absl::Span<const int32_t> ids, float* out) {
  absl::StatusOr<int64_t> row_bytes = gguf::RowBytes(table.type, table.cols);
  if (!row_bytes.ok()) return row_bytes.status();
  const auto* base = static_cast<const uint8_t*>(table.data);
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= table.rows) {
      return absl::InvalidArgumentError(
          absl::StrCat("GetRows: id ", ids[i], " outside [0, ", table.rows, ")"));
    }
    absl::Status st = gguf::DequantizeRow(table.type, base + ids[i] * *row_bytes,
                                          out + static_cast<int64_t>(i) * table.cols, table.cols);
    if (!st.ok()) return st;
  }
  return absl::OkStatus();
}

RopeTable::RopeTable(const RopeParams& params, int max_positions)
    : params_(params), max_positions_(max_positions) {}

absl::StatusOr<RopeTable> RopeTable::Create(const RopeParams& params, int max_positions) {
  bool factors_ok =
      params.freq_factors.empty() || static_cast<int>(params.freq_factors.size()) == params.head_dim / 2;
  for (float f : params.freq_factors) factors_ok = factors_ok && f > 0.0f && std::isfinite(f);
  if (params.head_dim <= 0 || params.head_dim % 2 != 0 || !(params.freq_base > 0.0f) ||
      !(params.freq_scale > 0.0f) || !(params.attn_factor > 0.0f) || max_positions <= 0 || !factors_ok ||
      (params.yarn && params.yarn_orig_ctx <= 0)) {
    return absl::InvalidArgumentError(absl::StrCat("RopeTable: bad params head_dim=", params.head_dim,
                                                   " base=", params.freq_base, " scale=", params.freq_scale,
                                                   " freq_factors=", params.freq_factors.size(),
                                                   " max_positions=", max_positions));
  }
  RopeTable table(params, max_positions);
  const int d = params.head_dim;
  table.cos_.resize(static_cast<size_t>(max_positions) * d);
  table.sin_.resize(static_cast<size_t>(max_positions) * d);
  for (int p = 0; p < max_positions; ++p) {
    for (int i = 0; i < d / 2; ++i) {
      const model::RopeAngle r = model::RopeAt(params, p, i);
      const float c = static_cast<float>(r.cos);
      const float s = static_cast<float>(r.sin);
      const size_t a = static_cast<size_t>(p) * d + (params.neox ? i : 2 * i);
      const size_t b = a + (params.neox ? d / 2 : 1);
      table.cos_[a] = c;
      table.cos_[b] = c;
      table.sin_[a] = -s;
      table.sin_[b] = s;
    }
  }
  return table;
}

absl::Status RopeTable::Apply(float* x, int n_tokens, int n_heads,
                              absl::Span<const int32_t> positions) const {
  if (positions.size() != static_cast<size_t>(n_tokens)) {
    return absl::InvalidArgumentError(
        absl::StrCat("Rope: ", positions.size(), " positions for ", n_tokens, " tokens"));
  }
  for (int t = 0; t < n_tokens; ++t) {
    if (positions[t] < 0 || positions[t] >= max_positions_) {
      return absl::InvalidArgumentError(
          absl::StrCat("Rope: position ", positions[t], " outside [0, ", max_positions_, ")"));
    }
  }
  const int d = params_.head_dim;
  const bool avx2 = UseAvx2();
  for (int t = 0; t < n_tokens; ++t) {
    const float* cs = cos_row(positions[t]);
    const float* sn = sin_row(positions[t]);
    for (int h = 0; h < n_heads; ++h) {
      float* xh = x + (static_cast<int64_t>(t) * n_heads + h) * d;  // [head_dim]
      if (params_.neox) {
        RopeHeadNeox(xh, cs, sn, d);
      } else if (avx2) {
        RopeHeadAvx2(xh, cs, sn, d);
      } else {
        RopeHeadScalar(xh, cs, sn, d);
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace kvcache::cpu
