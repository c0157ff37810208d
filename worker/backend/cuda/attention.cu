// Paged attention kernels (see attention.h for the contract).
#include "worker/backend/cuda/attention.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"
#include "worker/backend/cuda/cuda_check.h"
#include "worker/backend/cuda/kernel_math.h"

namespace kvcache::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kUnroll = 8;
constexpr unsigned kFullMask = 0xffffffffu;

// 8 consecutive 2-byte KV elements (16 bytes) to f32.
template <bool kBf16>
__device__ __forceinline__ void ToFloat8(const uint4& u, float* f) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if (kBf16) {
      f[2 * i] = __uint_as_float(w[i] << 16);
      f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    } else {
      const float2 v = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
      f[2 * i] = v.x;
      f[2 * i + 1] = v.y;
    }
  }
}

// k, v rows: [n_tokens] x row_stride floats; [kv_heads][head_dim] used.
static __global__ void WriteKvKernel(WriteKvArgs a) {
  const int t = blockIdx.y;
  const int64_t row = a.layout.row_elems();
  const bool bf16 = a.layout.dtype == cpu::KvDtype::kBF16;
  uint8_t* page = a.layout.page(a.kv_base, a.dst_page[t]);
  uint16_t* k_dst = reinterpret_cast<uint16_t*>(page + a.layout.k_offset(a.layer, a.dst_slot[t]));
  uint16_t* v_dst = reinterpret_cast<uint16_t*>(page + a.layout.v_offset(a.layer, a.dst_slot[t]));
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < row; i += int64_t{gridDim.x} * blockDim.x) {
    k_dst[i] = KvEncode(a.k[t * a.row_stride + i], bf16);
    v_dst[i] = KvEncode(a.v[t * a.row_stride + i], bf16);
  }
}

// Scratch: o [n_items][n_heads][max_splits][HD] then ml [n_items][n_heads][max_splits][2].
struct Scratch {
  float* o;
  float* ml;
};
__device__ __forceinline__ Scratch SplitScratch(const AttentionArgs& a) {
  const int64_t n = int64_t{a.n_items} * a.n_heads * a.max_splits;
  return Scratch{a.scratch, a.scratch + n * a.layout.head_dim};
}

// grid (max_splits, kv_heads, n_items), kThreads threads; dynamic shared memory
// (G*HD + G*kAttentionSplitTokens + kWarps*G*HD) floats.
// kG: compile-time bound on the group (accumulators live in registers).
template <int HD, bool kBf16, int kG>
static __global__ void __launch_bounds__(kThreads) AttentionSplitKernel(AttentionArgs a) {
  constexpr int kLanesPerToken = HD / 8;        // each lane loads 16 bytes
  constexpr int kTokensPerWarp = 32 / kLanesPerToken;
  constexpr int kTokensPerPass = kTokensPerWarp * kWarps;
  constexpr int S = kAttentionSplitTokens;
  const int split = blockIdx.x, kvh = blockIdx.y, item_idx = blockIdx.z;
  const AttentionItem item = a.items[item_idx];
  const int k_begin = FirstVisibleKey(item.pos, a.sliding_window);
  const int t0 = k_begin + split * S;
  if (t0 > item.pos) return;  // this item has fewer splits
  const int n_local = min(S, item.pos + 1 - t0);
  const int G = a.n_heads / a.layout.kv_heads;

  extern __shared__ float smem[];
  float* q_s = smem;            // [G][HD], pre-scaled
  float* p_s = q_s + G * HD;    // [G][S] scores, then probabilities
  float* red = p_s + G * S;     // [kWarps][G][HD]
  __shared__ float m_s[kG], l_s[kG];

  const float scale = a.scale != 0.0f ? a.scale : rsqrtf(static_cast<float>(HD));
  for (int i = threadIdx.x; i < G * HD; i += kThreads) {
    q_s[i] = a.q[item_idx * a.q_row_stride + (kvh * G) * HD + i] * scale;
  }
  __syncthreads();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int sub = lane / kLanesPerToken, li = lane % kLanesPerToken;
  const int32_t* pt = a.page_tables + a.seq_page_offset[item.seq];
  const uint8_t* base = static_cast<const uint8_t*>(a.kv_base);

  // Phase 1: scores. A warp scores kTokensPerWarp keys per load, kUnroll loads in flight.
  for (int b = warp * kTokensPerWarp; b < n_local; b += kTokensPerPass * kUnroll) {
    uint4 kr[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int j = b + sub + u * kTokensPerPass;
      kr[u] = make_uint4(0, 0, 0, 0);
      if (j < n_local) {
        kr[u] = __ldg(reinterpret_cast<const uint4*>(base + KvRowOffset(a.layout, pt, a.layer, t0 + j, kvh, false)) + li);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int j = b + sub + u * kTokensPerPass;
      float kf[8];
      ToFloat8<kBf16>(kr[u], kf);
#pragma unroll
      for (int g = 0; g < kG; ++g) {
        if (g < G) {
          const float* q = q_s + g * HD + li * 8;
          float d = 0.0f;
#pragma unroll
          for (int e = 0; e < 8; ++e) d = fmaf(kf[e], q[e], d);
#pragma unroll
          for (int off = kLanesPerToken / 2; off > 0; off /= 2) d += __shfl_xor_sync(kFullMask, d, off);
          if (li == 0 && j < n_local) p_s[g * S + j] = d;
        }
      }
    }
  }
  __syncthreads();

  // Phase 2: per head, max and sum of e^(s - max); p_s becomes e^(s - max).
  for (int g = warp; g < G; g += kWarps) {
    float m = -INFINITY;
    for (int j = lane; j < n_local; j += 32) m = fmaxf(m, p_s[g * S + j]);
    for (int off = 16; off > 0; off /= 2) m = fmaxf(m, __shfl_xor_sync(kFullMask, m, off));
    float l = 0.0f;
    for (int j = lane; j < n_local; j += 32) {
      const float p = expf(p_s[g * S + j] - m);
      p_s[g * S + j] = p;
      l += p;
    }
    for (int off = 16; off > 0; off /= 2) l += __shfl_xor_sync(kFullMask, l, off);
    if (lane == 0) {
      m_s[g] = m;
      l_s[g] = l;
    }
  }
  __syncthreads();

  // Phase 3: o[g][:] = sum_j p[g][j] V[j][:].
  float acc[kG][8];
#pragma unroll
  for (int g = 0; g < kG; ++g) {
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[g][e] = 0.0f;
  }
  for (int b = warp * kTokensPerWarp; b < n_local; b += kTokensPerPass * kUnroll) {
    uint4 vr[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int j = b + sub + u * kTokensPerPass;
      vr[u] = make_uint4(0, 0, 0, 0);
      if (j < n_local) {
        vr[u] = __ldg(reinterpret_cast<const uint4*>(base + KvRowOffset(a.layout, pt, a.layer, t0 + j, kvh, true)) + li);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int j = b + sub + u * kTokensPerPass;
      if (j < n_local) {
        float vf[8];
        ToFloat8<kBf16>(vr[u], vf);
#pragma unroll
        for (int g = 0; g < kG; ++g) {
          if (g < G) {
            const float p = p_s[g * S + j];
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[g][e] = fmaf(p, vf[e], acc[g][e]);
          }
        }
      }
    }
  }
  // Reduce over the tokens a warp held side by side, then over warps.
#pragma unroll
  for (int g = 0; g < kG; ++g) {
    if (g < G) {
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        float v = acc[g][e];
#pragma unroll
        for (int off = kLanesPerToken; off < 32; off *= 2) v += __shfl_xor_sync(kFullMask, v, off);
        if (sub == 0) red[(warp * G + g) * HD + li * 8 + e] = v;
      }
    }
  }
  __syncthreads();
  const Scratch sc = SplitScratch(a);
  for (int i = threadIdx.x; i < G * HD; i += kThreads) {
    float v = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) v += red[w * G * HD + i];
    const int g = i / HD, d = i % HD;
    const int64_t slot = (int64_t{item_idx} * a.n_heads + kvh * G + g) * a.max_splits + split;
    sc.o[slot * HD + d] = v;
  }
  if (threadIdx.x < G) {
    const int64_t slot = (int64_t{item_idx} * a.n_heads + kvh * G + threadIdx.x) * a.max_splits + split;
    sc.ml[slot * 2] = m_s[threadIdx.x];
    sc.ml[slot * 2 + 1] = l_s[threadIdx.x];
  }
}

// grid (n_items, n_heads), head_dim threads: merges an item's splits.
static __global__ void AttentionCombineKernel(AttentionArgs a) {
  const int item_idx = blockIdx.x, h = blockIdx.y, d = threadIdx.x;
  const int hd = a.layout.head_dim;
  const int n_splits = AttentionSplits(a.items[item_idx].pos, a.sliding_window);
  const Scratch sc = SplitScratch(a);
  const int64_t first = (int64_t{item_idx} * a.n_heads + h) * a.max_splits;
  float m = -INFINITY;
  for (int s = 0; s < n_splits; ++s) m = fmaxf(m, sc.ml[(first + s) * 2]);
  float l = 0.0f, o = 0.0f;
  for (int s = 0; s < n_splits; ++s) {
    const float f = expf(sc.ml[(first + s) * 2] - m);
    l += sc.ml[(first + s) * 2 + 1] * f;
    o += sc.o[(first + s) * hd + d] * f;
  }
  const float out = o / l;
  const int64_t at = (int64_t{item_idx} * a.n_heads + h) * hd + d;
  if (a.out_f16 != nullptr) a.out_f16[at] = __half_as_ushort(__float2half_rn(out));
  if (a.out_f32 != nullptr) a.out_f32[at] = out;
}

template <int HD, int kG>
void LaunchSplitG(const AttentionArgs& a, cudaStream_t stream) {
  const int group = a.n_heads / a.layout.kv_heads;
  const size_t smem = sizeof(float) * static_cast<size_t>(group * HD * (1 + kWarps) + group * kAttentionSplitTokens);
  const dim3 grid(a.max_splits, a.layout.kv_heads, a.n_items);
  if (a.layout.dtype == cpu::KvDtype::kBF16) {
    AttentionSplitKernel<HD, true, kG><<<grid, kThreads, smem, stream>>>(a);
  } else {
    AttentionSplitKernel<HD, false, kG><<<grid, kThreads, smem, stream>>>(a);
  }
}

template <int HD>
absl::Status LaunchSplit(const AttentionArgs& a, cudaStream_t stream) {
  const int group = a.n_heads / a.layout.kv_heads;
  if (group <= 1) {
    LaunchSplitG<HD, 1>(a, stream);
  } else if (group <= 2) {
    LaunchSplitG<HD, 2>(a, stream);
  } else if (group <= 3) {
    LaunchSplitG<HD, 3>(a, stream);
  } else if (group <= 4) {
    LaunchSplitG<HD, 4>(a, stream);
  } else {
    LaunchSplitG<HD, kMaxAttentionGroup>(a, stream);
  }
  return LastLaunchStatus("AttentionSplitKernel");
}

}  // namespace

absl::Status AttentionSupports(const cpu::PageLayout& layout, int n_heads) {
  if (layout.head_dim != 32 && layout.head_dim != 64 && layout.head_dim != 128) {
    return absl::UnimplementedError(
        absl::StrCat("CUDA attention supports head_dim 32, 64 or 128, not ", layout.head_dim));
  }
  if (layout.dtype != cpu::KvDtype::kF16 && layout.dtype != cpu::KvDtype::kBF16) {
    return absl::UnimplementedError("CUDA attention needs f16 or bf16 KV pages");
  }
  if (layout.kv_heads <= 0 || n_heads % layout.kv_heads != 0 || n_heads / layout.kv_heads > kMaxAttentionGroup) {
    return absl::UnimplementedError(absl::StrCat("CUDA attention: ", n_heads, " query heads over ", layout.kv_heads,
                                                 " kv heads (group must divide and be <= ", kMaxAttentionGroup, ")"));
  }
  return absl::OkStatus();
}

int64_t AttentionScratchFloats(int n_items, int n_heads, int head_dim, int max_splits) {
  return int64_t{n_items} * n_heads * max_splits * (head_dim + 2);
}

absl::Status WriteKv(const WriteKvArgs& args, cudaStream_t stream) {
  if (args.n_tokens <= 0) return absl::OkStatus();
  if (args.n_tokens > 65535) return absl::InvalidArgumentError("WriteKv: more than 65535 tokens");
  const int threads = 256;
  const int64_t row = args.layout.row_elems();
  const dim3 grid(static_cast<unsigned>((row + threads - 1) / threads), args.n_tokens);
  WriteKvKernel<<<grid, threads, 0, stream>>>(args);
  return LastLaunchStatus("WriteKvKernel");
}

absl::Status PagedAttention(const AttentionArgs& args, cudaStream_t stream) {
  if (args.n_items <= 0) return absl::OkStatus();
  if (args.n_items > 65535 || args.max_splits <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("PagedAttention: ", args.n_items, " items, ", args.max_splits, " splits"));
  }
  if (absl::Status s = AttentionSupports(args.layout, args.n_heads); !s.ok()) return s;
  const absl::Status launched = args.layout.head_dim == 32   ? LaunchSplit<32>(args, stream)
                                : args.layout.head_dim == 64 ? LaunchSplit<64>(args, stream)
                                                             : LaunchSplit<128>(args, stream);
  if (!launched.ok()) return launched;
  AttentionCombineKernel<<<dim3(args.n_items, args.n_heads), args.layout.head_dim, 0, stream>>>(args);
  return LastLaunchStatus("AttentionCombineKernel");
}

}  // namespace kvcache::cuda
