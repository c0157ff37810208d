// Paged attention kernels (see attention.h for the contract).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"
#include "worker/backend/cuda/attention.h"
#include "worker/backend/cuda/cuda_check.h"
#include "worker/backend/cuda/kernel_math.h"

namespace kvcache::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr float kLog2e = 1.4426950408889634f;
// A launch's splits are kAttentionSplitTokens * f keys, f in {1, 2, 4}: larger
// splits when there are blocks enough to fill the device (less per-block set-up).
constexpr int kMaxSplitFactor = 4;
constexpr int kMaxSplitTokens = kAttentionSplitTokens * kMaxSplitFactor;

// 2^x in one MUFU op (2^-inf = 0); the scores are f32 and the tolerance is 5e-4.
__device__ __forceinline__ float Exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

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
  if (a.dst_page[t] < 0) return;  // a padding row of a graph step
  const int64_t row = a.layout.row_elems();
  const bool bf16 = a.layout.dtype == kv::KvDtype::kBF16;
  uint8_t* page = a.layout.page(a.kv_base, a.dst_page[t]);
  uint16_t* k_dst = reinterpret_cast<uint16_t*>(page + a.layout.k_offset(a.layer, a.dst_slot[t]));
  uint16_t* v_dst = reinterpret_cast<uint16_t*>(page + a.layout.v_offset(a.layer, a.dst_slot[t]));
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < row;
       i += int64_t{gridDim.x} * blockDim.x) {
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

// One pass over a split's keys with the online softmax (flash-decoding). grid
// (kv_heads, max_splits, n_items): the kv heads of one split run side by side, so
// the page rows they read ([page_tokens][kv_heads][HD] per layer) are fetched
// together. kThreads threads; a group of HD/8 lanes holds one key (16 bytes a
// lane) and each lane issues kU loads of K and kU of V before any arithmetic.
// Each lane group keeps its own running max / sum / output for the kG heads of
// the group in registers; they are merged across the warp by shuffles and across
// warps through shared memory. Scores are in log2 units (q is pre-scaled by
// log2(e)), so the split's m is too; AttentionCombineKernel uses exp2 as well.
// kG: compile-time bound on the group (accumulators live in registers).
// split_tokens: keys per split (a multiple of kAttentionSplitTokens, at most kMaxSplitTokens).
template <int HD, bool kBf16, int kG>
static __global__ void __launch_bounds__(kThreads, kG <= 3 ? 4 : 2)
    AttentionSplitKernel(AttentionArgs a, int split_tokens) {
  constexpr int kLanesPerToken = HD / 8;  // each lane loads 16 bytes of a row
  constexpr int kTokensPerLoad = 32 / kLanesPerToken;
  constexpr int kU = kG <= 2 ? 8 : 4;  // K and V loads in flight per lane
  constexpr int kChunk = kTokensPerLoad * kU;
  const int S = split_tokens;
  const int kvh = blockIdx.x, split = blockIdx.y, item_idx = blockIdx.z;
  const AttentionItem item = a.items[item_idx];
  const int k_begin = FirstVisibleKey(item.pos, a.sliding_window);
  const int t0 = k_begin + split * S;
  if (t0 > item.pos) return;  // this item has fewer splits
  const int n_local = min(S, item.pos + 1 - t0);
  const int G = a.n_heads / a.layout.kv_heads;

  __shared__ float o_w[kWarps][kG][HD];
  __shared__ float m_w[kWarps][kG], l_w[kWarps][kG];
  __shared__ int64_t off_s[kMaxSplitTokens];  // slab offset of each key's K row (this kv head)

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int sub = lane / kLanesPerToken, li = lane % kLanesPerToken;

  // q: this lane's 8 dims of each head of the group, scaled by scale * log2(e).
  const float scale = (a.scale != 0.0f ? a.scale : rsqrtf(static_cast<float>(HD))) * kLog2e;
  float q[kG][8];
#pragma unroll
  for (int g = 0; g < kG; ++g) {
    const float* qp = a.q + item_idx * a.q_row_stride + (kvh * G + g) * HD + li * 8;
#pragma unroll
    for (int e = 0; e < 8; ++e) q[g][e] = g < G ? __ldg(qp + e) * scale : 0.0f;
  }
  float m[kG], l[kG], acc[kG][8];
#pragma unroll
  for (int g = 0; g < kG; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.0f;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[g][e] = 0.0f;
  }

  // Every key's K-row offset, once per block: the loop's addresses then need no
  // division and no dependent global load.
  const int pt_tokens = a.layout.page_tokens;
  {
    const int32_t* pt = a.page_tables + a.seq_page_offset[item.seq];
    const int64_t page_bytes = a.layout.page_bytes();
    // Within a page: the layer's K block, then its V block, [page_tokens][kv_heads][HD] each.
    const int64_t k_base = a.layout.k_offset(a.layer, 0) + int64_t{kvh} * HD * 2;
    for (int j = threadIdx.x; j < n_local; j += kThreads) {
      const int t = t0 + j, p = t / pt_tokens;
      off_s[j] = int64_t{pt[p]} * page_bytes + k_base + int64_t{t - p * pt_tokens} * a.layout.row_bytes();
    }
  }
  __syncthreads();
  const uint8_t* base = static_cast<const uint8_t*>(a.kv_base) + li * 16;
  const int64_t v_delta = int64_t{pt_tokens} * a.layout.row_bytes();  // K row -> V row

  for (int c = warp * kChunk; c < n_local; c += kWarps * kChunk) {
    uint4 kr[kU], vr[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int j = c + u * kTokensPerLoad + sub;
      kr[u] = make_uint4(0, 0, 0, 0);
      vr[u] = make_uint4(0, 0, 0, 0);
      if (j < n_local) {
        const uint8_t* row = base + off_s[j];
        kr[u] = __ldg(reinterpret_cast<const uint4*>(row));
        vr[u] = __ldg(reinterpret_cast<const uint4*>(row + v_delta));
      }
    }
    // Scores of this lane group's kU keys (every lane of the group gets the sum).
    float s[kU][kG];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const bool valid = c + u * kTokensPerLoad + sub < n_local;
      float kf[8];
      ToFloat8<kBf16>(kr[u], kf);
#pragma unroll
      for (int g = 0; g < kG; ++g) {
        float d = 0.0f;
#pragma unroll
        for (int e = 0; e < 8; ++e) d = fmaf(kf[e], q[g][e], d);
#pragma unroll
        for (int off = kLanesPerToken / 2; off > 0; off /= 2) d += __shfl_xor_sync(kFullMask, d, off);
        s[u][g] = valid ? d : -INFINITY;
      }
    }
    // Online softmax: rescale once per chunk to the chunk's new max.
#pragma unroll
    for (int g = 0; g < kG; ++g) {
      float cm = m[g];
#pragma unroll
      for (int u = 0; u < kU; ++u) cm = fmaxf(cm, s[u][g]);
      const float ref = cm == -INFINITY ? 0.0f : cm;  // no valid key yet: keep everything 0
      const float f = Exp2(m[g] - ref);
      float sum = 0.0f;
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        s[u][g] = Exp2(s[u][g] - ref);  // now the probability weight
        sum += s[u][g];
      }
      l[g] = l[g] * f + sum;
      m[g] = cm;
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[g][e] *= f;
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      float vf[8];
      ToFloat8<kBf16>(vr[u], vf);
#pragma unroll
      for (int g = 0; g < kG; ++g) {
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[g][e] = fmaf(s[u][g], vf[e], acc[g][e]);
      }
    }
  }

  // Merge the lane groups of the warp (they hold different keys, same dims).
#pragma unroll
  for (int off = kLanesPerToken; off < 32; off *= 2) {
#pragma unroll
    for (int g = 0; g < kG; ++g) {
      const float mo = __shfl_xor_sync(kFullMask, m[g], off);
      const float lo = __shfl_xor_sync(kFullMask, l[g], off);
      const float mn = fmaxf(m[g], mo);
      const float ref = mn == -INFINITY ? 0.0f : mn;
      const float fa = Exp2(m[g] - ref), fb = Exp2(mo - ref);
      l[g] = l[g] * fa + lo * fb;
      m[g] = mn;
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float ao = __shfl_xor_sync(kFullMask, acc[g][e], off);
        acc[g][e] = acc[g][e] * fa + ao * fb;
      }
    }
  }
  if (sub == 0) {
#pragma unroll
    for (int g = 0; g < kG; ++g) {
#pragma unroll
      for (int e = 0; e < 8; ++e) o_w[warp][g][li * 8 + e] = acc[g][e];
      if (li == 0) {
        m_w[warp][g] = m[g];
        l_w[warp][g] = l[g];
      }
    }
  }
  __syncthreads();

  // Merge the warps and write the split's partial (o unnormalised, m in log2 units).
  const Scratch sc = SplitScratch(a);
  const bool only_split = k_begin + S > item.pos;  // the whole result: write the output directly
  for (int i = threadIdx.x; i < G * HD; i += kThreads) {
    const int g = i / HD, d = i % HD;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, m_w[w][g]);
    const float ref = mx == -INFINITY ? 0.0f : mx;
    float o = 0.0f, lsum = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float f = Exp2(m_w[w][g] - ref);
      o = fmaf(o_w[w][g][d], f, o);
      lsum = fmaf(l_w[w][g], f, lsum);
    }
    if (only_split) {
      const int64_t at = (int64_t{item_idx} * a.n_heads + kvh * G + g) * HD + d;
      if (a.out_f16 != nullptr) a.out_f16[at] = __half_as_ushort(__float2half_rn(o / lsum));
      if (a.out_f32 != nullptr) a.out_f32[at] = o / lsum;
      continue;
    }
    const int64_t slot = (int64_t{item_idx} * a.n_heads + kvh * G + g) * a.max_splits + split;
    sc.o[slot * HD + d] = o;
    if (d == 0) {
      sc.ml[slot * 2] = mx;
      sc.ml[slot * 2 + 1] = lsum;
    }
  }
}

// grid (n_items, n_heads), head_dim threads: merges an item's splits (m in log2
// units); an item with one split was written by the split kernel.
static __global__ void AttentionCombineKernel(AttentionArgs a, int split_tokens) {
  const int item_idx = blockIdx.x, h = blockIdx.y, d = threadIdx.x;
  const int hd = a.layout.head_dim;
  const int pos = a.items[item_idx].pos;
  const int n_splits = (pos + 1 - FirstVisibleKey(pos, a.sliding_window) + split_tokens - 1) / split_tokens;
  if (n_splits <= 1) return;
  const Scratch sc = SplitScratch(a);
  const int64_t first = (int64_t{item_idx} * a.n_heads + h) * a.max_splits;
  float m = -INFINITY;
  for (int s = 0; s < n_splits; ++s) m = fmaxf(m, sc.ml[(first + s) * 2]);
  const float ref = m == -INFINITY ? 0.0f : m;
  float l = 0.0f, o = 0.0f;
  for (int s = 0; s < n_splits; ++s) {
    const float f = Exp2(sc.ml[(first + s) * 2] - ref);  // m is in log2 units
    l += sc.ml[(first + s) * 2 + 1] * f;
    o += sc.o[(first + s) * hd + d] * f;
  }
  const float out = o / l;
  const int64_t at = (int64_t{item_idx} * a.n_heads + h) * hd + d;
  if (a.out_f16 != nullptr) a.out_f16[at] = __half_as_ushort(__float2half_rn(out));
  if (a.out_f32 != nullptr) a.out_f32[at] = out;
}

template <int HD, int kG>
void LaunchSplitG(const AttentionArgs& a, int factor, cudaStream_t stream) {
  const dim3 grid(a.layout.kv_heads, (a.max_splits + factor - 1) / factor, a.n_items);
  const int split_tokens = kAttentionSplitTokens * factor;
  if (a.layout.dtype == kv::KvDtype::kBF16) {
    AttentionSplitKernel<HD, true, kG><<<grid, kThreads, 0, stream>>>(a, split_tokens);
  } else {
    AttentionSplitKernel<HD, false, kG><<<grid, kThreads, 0, stream>>>(a, split_tokens);
  }
}

template <int HD>
absl::Status LaunchSplit(const AttentionArgs& a, int factor, cudaStream_t stream) {
  const int group = a.n_heads / a.layout.kv_heads;
  if (group <= 1) {
    LaunchSplitG<HD, 1>(a, factor, stream);
  } else if (group <= 2) {
    LaunchSplitG<HD, 2>(a, factor, stream);
  } else if (group <= 3) {
    LaunchSplitG<HD, 3>(a, factor, stream);
  } else if (group <= 4) {
    LaunchSplitG<HD, 4>(a, factor, stream);
  } else {
    LaunchSplitG<HD, kMaxAttentionGroup>(a, factor, stream);
  }
  return LastLaunchStatus("AttentionSplitKernel");
}

}  // namespace

absl::Status AttentionSupports(const kv::PageLayout& layout, int n_heads) {
  if (layout.head_dim != 32 && layout.head_dim != 64 && layout.head_dim != 128) {
    return absl::UnimplementedError(
        absl::StrCat("CUDA attention supports head_dim 32, 64 or 128, not ", layout.head_dim));
  }
  if (layout.dtype != kv::KvDtype::kF16 && layout.dtype != kv::KvDtype::kBF16) {
    return absl::UnimplementedError("CUDA attention needs f16 or bf16 KV pages");
  }
  if (layout.kv_heads <= 0 || n_heads % layout.kv_heads != 0 ||
      n_heads / layout.kv_heads > kMaxAttentionGroup) {
    return absl::UnimplementedError(
        absl::StrCat("CUDA attention: ", n_heads, " query heads over ", layout.kv_heads,
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
  if (args.n_items > 65535 || args.max_splits <= 0 || args.max_splits > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("PagedAttention: ", args.n_items, " items, ", args.max_splits, " splits"));
  }
  if (absl::Status s = AttentionSupports(args.layout, args.n_heads); !s.ok()) return s;
  // Split factor: the largest (<= kMaxSplitFactor) that still gives every
  // multiprocessor kBlocksPerSm blocks to run (a few waves of resident blocks).
  constexpr int64_t kBlocksPerSm = 8;
  int device = 0, sms = 0;
  KVCACHE_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device), "PagedAttention: cudaGetDevice");
  KVCACHE_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device),
                               "PagedAttention: multiprocessor count");
  int factor = 1;
  const int64_t rows = int64_t{args.n_items} * args.layout.kv_heads;
  while (factor < kMaxSplitFactor && factor < args.max_splits &&
         rows * ((args.max_splits + 2 * factor - 1) / (2 * factor)) >= kBlocksPerSm * sms) {
    factor *= 2;
  }
  const absl::Status launched = args.layout.head_dim == 32   ? LaunchSplit<32>(args, factor, stream)
                                : args.layout.head_dim == 64 ? LaunchSplit<64>(args, factor, stream)
                                                             : LaunchSplit<128>(args, factor, stream);
  if (!launched.ok()) return launched;
  if (args.max_splits <= factor) return absl::OkStatus();  // every item has one split
  AttentionCombineKernel<<<dim3(args.n_items, args.n_heads), args.layout.head_dim, 0, stream>>>(
      args, kAttentionSplitTokens * factor);
  return LastLaunchStatus("AttentionCombineKernel");
}

}  // namespace kvcache::cuda
