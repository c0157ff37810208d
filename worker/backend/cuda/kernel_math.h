// Scalar math of the Llama forward pass shared by the CUDA kernels and host code,
// written once as KV_HD (`__host__ __device__` under nvcc) helpers and tested on
// the CPU against the CPU backend (tests/worker/backend/cuda/kernel_math_test.cc).
// Page addressing comes from worker/kv/page_layout.h and f16/bf16
// rounding from common/gguf/fp16.h, both KV_HD as well.
//
// No CUDA header: includable from host-only code.
//
// Thread-safety: pure functions and plain values.
#ifndef KVCACHE_WORKER_BACKEND_CUDA_KERNEL_MATH_H_
#define KVCACHE_WORKER_BACKEND_CUDA_KERNEL_MATH_H_

#include <math.h>

#include <cmath>
#include <cstdint>

#include "common/gguf/fp16.h"  // KV_HD
#include "worker/kv/page_layout.h"

namespace kvcache::cuda {

// Keys one attention split covers (a thread block's share of one query's keys).
inline constexpr int kAttentionSplitTokens = 256;
// Largest query-head group (n_heads / kv_heads) one attention block serves.
inline constexpr int kMaxAttentionGroup = 8;

// silu(g) * u, silu(g) = g / (1 + e^-g): the CPU backend's SwiGlu, element-wise.
KV_HD inline float SwiGluValue(float gate, float up) { return gate / (1.0f + expf(-gate)) * up; }

// The factor RMSNorm multiplies a row by: 1 / sqrt(mean(x^2) + eps), given the
// row's sum of squares over n elements.
KV_HD inline float RmsScale(float sum_sq, int64_t n, float eps) {
  return 1.0f / sqrtf(sum_sq / static_cast<float>(n) + eps);
}

// Rotates one pair (adjacent for llama NORM RoPE, half a head apart for NeoX) by
// the angle whose cos/sin are given.
KV_HD inline void RopeRotate(float* x0, float* x1, float c, float s) {
  const float a = *x0, b = *x1;
  *x0 = a * c - b * s;
  *x1 = b * c + a * s;
}

// First key position a query at `pos` attends to (sliding window > 0 keeps the
// last `window` positions, the query's own included).
KV_HD inline int FirstVisibleKey(int pos, int window) {
  return window > 0 ? (pos - window + 1 > 0 ? pos - window + 1 : 0) : 0;
}

// Number of kAttentionSplitTokens-key splits a query at `pos` needs.
KV_HD inline int AttentionSplits(int pos, int window) {
  const int n_keys = pos + 1 - FirstVisibleKey(pos, window);
  return (n_keys + kAttentionSplitTokens - 1) / kAttentionSplitTokens;
}

// The partial result of softmax attention over a subset of keys:
//   m = max score, l = sum e^(score - m), o = sum e^(score - m) v  (unnormalised).
// Merging two partials rescales both to the larger max; the final output is o / l.
struct SoftmaxPartial {
  float m = -INFINITY;
  float l = 0.0f;
};

// Folds partial b (with its outputs ob) into a (outputs oa), n values each.
KV_HD inline void MergeSoftmaxPartial(SoftmaxPartial* a, float* oa, const SoftmaxPartial& b, const float* ob,
                                      int n) {
  if (b.l == 0.0f) return;
  const float m = a->m > b.m ? a->m : b.m;
  const float fa = a->l == 0.0f ? 0.0f : expf(a->m - m);
  const float fb = expf(b.m - m);
  for (int i = 0; i < n; ++i) oa[i] = oa[i] * fa + ob[i] * fb;
  a->l = a->l * fa + b.l * fb;
  a->m = m;
}

// Byte offset, within a tier-0 slab, of the K (v = false) or V row of `kv_head`
// for the token at `pos`, whose page is page_table[pos / page_tokens].
KV_HD inline int64_t KvRowOffset(const kv::PageLayout& L, const int32_t* page_table, int layer, int pos,
                                 int kv_head, bool v) {
  const int page = page_table[pos / L.page_tokens];
  const int slot = pos % L.page_tokens;
  return int64_t{page} * L.page_bytes() + (v ? L.v_offset(layer, slot) : L.k_offset(layer, slot)) +
         int64_t{kv_head} * L.head_dim * L.elt_bytes();
}

// f32 -> the KV dtype's bits, rounded to nearest even (bit-exact with the CPU
// backend's WriteKv).
KV_HD inline uint16_t KvEncode(float x, bool bf16) {
  return bf16 ? gguf::Fp32ToBf16(x) : gguf::Fp32ToFp16(x);
}
KV_HD inline float KvDecode(uint16_t bits, bool bf16) {
  return bf16 ? gguf::Bf16ToFp32(bits) : gguf::Fp16ToFp32(bits);
}

}  // namespace kvcache::cuda

#endif  // KVCACHE_WORKER_BACKEND_CUDA_KERNEL_MATH_H_
