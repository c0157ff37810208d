// Kernels over weights in their GGUF encoding (see weight_kernels.h).
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "absl/strings/str_cat.h"
#include "common/gguf/dequant_chunk.h"
#include "worker/backend/cuda/cuda_check.h"
#include "worker/backend/cuda/weight_kernels.h"

namespace kvcache::cuda {
namespace {

using gguf::GgmlType;
using gguf::kChunk;

constexpr int kWarp = 32;
constexpr int kMatVecRowsPerBlock = 4;  // one warp a row

// grid ceil(rows / kMatVecRowsPerBlock), block (32, kMatVecRowsPerBlock). Lane k of
// a row's warp takes chunks k, k + 32, ...; T >= n_tokens accumulators.
template <GgmlType Type, int T>
__global__ void MatVecKernel(const uint8_t* w, int64_t rows, int64_t row_bytes, int64_t n_chunks,
                             const uint16_t* x, int n_tokens, float* y, int64_t ldy, float beta) {
  const int64_t r = int64_t{blockIdx.x} * kMatVecRowsPerBlock + threadIdx.y;
  if (r >= rows) return;  // the whole warp: threadIdx.y is the warp's
  const uint8_t* row = w + r * row_bytes;
  const int64_t cols = n_chunks * kChunk;
  float acc[T];
#pragma unroll
  for (int t = 0; t < T; ++t) acc[t] = 0.0f;
  for (int64_t k = threadIdx.x; k < n_chunks; k += kWarp) {
    float v[kChunk];
    gguf::DequantChunk8<Type>(row, k, v);
#pragma unroll
    for (int t = 0; t < T; ++t) {
      if (t >= n_tokens) break;
      const uint4 raw = *reinterpret_cast<const uint4*>(x + t * cols + k * kChunk);
      const __half2* h = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
      for (int j = 0; j < kChunk / 2; ++j) {
        const float2 f = __half22float2(h[j]);
        acc[t] = fmaf(v[2 * j], f.x, acc[t]);
        acc[t] = fmaf(v[2 * j + 1], f.y, acc[t]);
      }
    }
  }
#pragma unroll
  for (int t = 0; t < T; ++t) {
#pragma unroll
    for (int off = kWarp / 2; off > 0; off /= 2) acc[t] += __shfl_xor_sync(0xffffffffu, acc[t], off);
  }
  if (threadIdx.x != 0) return;
  for (int t = 0; t < n_tokens; ++t) {
    float* out = y + t * ldy + r;
    *out = beta == 0.0f ? acc[t] : acc[t] + beta * *out;
  }
}

// One thread a chunk of [n_rows][n_chunks] chunks, grid-stride.
template <GgmlType Type>
__global__ void DequantizeF16Kernel(const uint8_t* w, int64_t row_bytes, int64_t n_chunks, int64_t total,
                                    uint16_t* out) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * blockDim.x) {
    float v[kChunk];
    gguf::DequantChunk8<Type>(w + (i / n_chunks) * row_bytes, i % n_chunks, v);
    uint4 packed;
    __half2* h = reinterpret_cast<__half2*>(&packed);
#pragma unroll
    for (int j = 0; j < kChunk / 2; ++j) h[j] = __floats2half2_rn(v[2 * j], v[2 * j + 1]);
    reinterpret_cast<uint4*>(out)[i] = packed;  // chunk i is halves 8i..8i+7
  }
}

// grid (ceil(n_chunks / 128), n_tokens), one thread a chunk of a token's row.
template <GgmlType Type>
__global__ void EmbeddingKernel(const uint8_t* table, int64_t row_bytes, int64_t n_chunks, const int32_t* ids,
                                float* out) {
  const int64_t t = blockIdx.y;
  const int64_t k = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (k >= n_chunks) return;
  float v[kChunk];
  gguf::DequantChunk8<Type>(table + int64_t{ids[t]} * row_bytes, k, v);
  float* o = out + (t * n_chunks + k) * kChunk;
#pragma unroll
  for (int i = 0; i < kChunk; ++i) o[i] = v[i];
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <int T>
void LaunchMatVec(const DeviceWeight& w, const uint16_t* x, int n_tokens, float* y, int64_t ldy, float beta,
                  cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((w.rows + kMatVecRowsPerBlock - 1) / kMatVecRowsPerBlock));
  const dim3 block(kWarp, kMatVecRowsPerBlock);
  gguf::VisitChunkType(w.type, [&](auto tag) {
    MatVecKernel<decltype(tag)::value, T>
        <<<grid, block, 0, stream>>>(w.data, w.rows, w.row_bytes, w.cols / kChunk, x, n_tokens, y, ldy, beta);
  });
}

}  // namespace

absl::Status WeightKernelsSupport(gguf::GgmlType type, int64_t cols) {
  if (!gguf::ChunkDecodable(type)) {
    return absl::UnimplementedError(absl::StrCat("the CUDA backend has no kernel for ", gguf::TypeName(type),
                                                 " weights (it reads f32, f16, bf16, q4_0, q4_1, q5_0, "
                                                 "q5_1, q8_0, q4_K, q5_K and q6_K)"));
  }
  if (cols <= 0 || cols % kChunk != 0) {
    return absl::UnimplementedError(absl::StrCat("the CUDA backend needs weight rows of a multiple of ",
                                                 kChunk, " elements, not ", cols));
  }
  return absl::OkStatus();
}

absl::Status MatVec(const DeviceWeight& w, const uint16_t* x, int n_tokens, float* y, int64_t ldy, float beta,
                    cudaStream_t stream) {
  if (n_tokens < 1 || n_tokens > kMatVecMaxTokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("MatVec: ", n_tokens, " tokens (1..", kMatVecMaxTokens, ")"));
  }
  if (!Aligned16(x)) return absl::InvalidArgumentError("MatVec: x is not 16-byte aligned");
  if (absl::Status s = WeightKernelsSupport(w.type, w.cols); !s.ok()) return s;
  if (w.rows <= 0) return absl::OkStatus();
  if (n_tokens == 1) {
    LaunchMatVec<1>(w, x, n_tokens, y, ldy, beta, stream);
  } else if (n_tokens == 2) {
    LaunchMatVec<2>(w, x, n_tokens, y, ldy, beta, stream);
  } else if (n_tokens <= 4) {
    LaunchMatVec<4>(w, x, n_tokens, y, ldy, beta, stream);
  } else {
    static_assert(kMatVecMaxTokens == 8, "instantiate MatVecKernel up to kMatVecMaxTokens");
    LaunchMatVec<8>(w, x, n_tokens, y, ldy, beta, stream);
  }
  return LastLaunchStatus("MatVecKernel");
}

absl::Status DequantizeRowsToF16(const DeviceWeight& w, int64_t row0, int64_t n_rows, uint16_t* out,
                                 cudaStream_t stream) {
  if (row0 < 0 || n_rows < 0 || row0 + n_rows > w.rows) {
    return absl::InvalidArgumentError(
        absl::StrCat("DequantizeRowsToF16: rows [", row0, ", ", row0 + n_rows, ") of ", w.rows));
  }
  if (!Aligned16(out)) return absl::InvalidArgumentError("DequantizeRowsToF16: out is not 16-byte aligned");
  if (absl::Status s = WeightKernelsSupport(w.type, w.cols); !s.ok()) return s;
  const int64_t n_chunks = w.cols / kChunk, total = n_rows * n_chunks;
  if (total == 0) return absl::OkStatus();
  const int threads = 256;
  const int64_t blocks = (total + threads - 1) / threads;
  const unsigned grid = static_cast<unsigned>(blocks < 65535 * 8 ? blocks : 65535 * 8);
  gguf::VisitChunkType(w.type, [&](auto tag) {
    DequantizeF16Kernel<decltype(tag)::value>
        <<<grid, threads, 0, stream>>>(w.data + row0 * w.row_bytes, w.row_bytes, n_chunks, total, out);
  });
  return LastLaunchStatus("DequantizeF16Kernel");
}

absl::Status EmbeddingLookup(const DeviceWeight& table, const int32_t* ids, int n_tokens, float* out,
                             cudaStream_t stream) {
  if (n_tokens <= 0) return absl::OkStatus();
  if (n_tokens > 65535) return absl::InvalidArgumentError("EmbeddingLookup: more than 65535 tokens");
  if (absl::Status s = WeightKernelsSupport(table.type, table.cols); !s.ok()) return s;
  const int64_t n_chunks = table.cols / kChunk;
  const dim3 grid(static_cast<unsigned>((n_chunks + 127) / 128), static_cast<unsigned>(n_tokens));
  gguf::VisitChunkType(table.type, [&](auto tag) {
    EmbeddingKernel<decltype(tag)::value>
        <<<grid, 128, 0, stream>>>(table.data, table.row_bytes, n_chunks, ids, out);
  });
  return LastLaunchStatus("EmbeddingKernel");
}

}  // namespace kvcache::cuda
