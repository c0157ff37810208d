// Kernels that read weights kept on the device in their GGUF encoding, so that a
// model takes its file's size in device memory (an 8B Q4_K_M about 5 GB, not the
// 16 GB of f16 copies). Each thread decodes 8 consecutive elements with
// common/gguf/dequant_chunk.h (the CPU's DequantizeRow values, bit for bit):
//   - MatVec: y = x·Wᵀ for up to kMatVecMaxTokens tokens, one warp per row, the
//     weights decoded in registers (decode steps read each weight byte once);
//   - DequantizeRowsToF16: rows of W to an f16 scratch matrix that cuBLAS then
//     multiplies (prompt chunks and large batches, where tensor cores pay for
//     the extra pass);
//   - EmbeddingLookup: rows of the token table to f32.
//
// Host-only header: no CUDA include.
//
// Thread-safety: launchers are reentrant; ordering is the stream's.
#ifndef KVCACHE_WORKER_BACKEND_CUDA_WEIGHT_KERNELS_H_
#define KVCACHE_WORKER_BACKEND_CUDA_WEIGHT_KERNELS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "common/gguf/ggml_types.h"
#include "worker/backend/cuda/stream.h"

namespace kvcache::cuda {

// A [rows][cols] matrix on the device, rows of row_bytes bytes in `type`'s
// encoding (GGUF's own layout, copied unchanged from the file).
struct DeviceWeight {
  gguf::GgmlType type = gguf::GgmlType::kF16;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t row_bytes = 0;
  const uint8_t* data = nullptr;
};

// OK when the kernels read a matrix of `type` with `cols` columns (a type
// gguf::ChunkDecodable accepts and cols a positive multiple of 8); UNIMPLEMENTED
// naming the type and width otherwise.
absl::Status WeightKernelsSupport(gguf::GgmlType type, int64_t cols);

// Token counts up to this use MatVec; larger ones DequantizeRowsToF16 + cuBLAS.
inline constexpr int kMatVecMaxTokens = 8;

// y[t][r] = beta * y[t][r] + sum_c w[r][c] * x[t][c] for t < n_tokens, r < w.rows,
// accumulated in f32 (y is not read when beta == 0).
//   x: device [n_tokens][w.cols] f16 bits, 16-byte aligned; y: [n_tokens][ldy] f32.
// INVALID_ARGUMENT when n_tokens is outside [1, kMatVecMaxTokens], x is
// misaligned, or WeightKernelsSupport fails.
absl::Status MatVec(const DeviceWeight& w, const uint16_t* x, int n_tokens, float* y, int64_t ldy, float beta,
                    cudaStream_t stream);

// out[r][c] = f16(w[row0 + r][c]) for r < n_rows, rounded to nearest.
//   out: device [n_rows][w.cols] f16 bits, 16-byte aligned.
absl::Status DequantizeRowsToF16(const DeviceWeight& w, int64_t row0, int64_t n_rows, uint16_t* out,
                                 cudaStream_t stream);

// out[t][:] = f32(table[ids[t]][:]).  ids: device [n_tokens] (checked against the
// vocabulary by the caller); out: [n_tokens][table.cols] f32.
absl::Status EmbeddingLookup(const DeviceWeight& table, const int32_t* ids, int n_tokens, float* out,
                             cudaStream_t stream);

}  // namespace kvcache::cuda

#endif  // KVCACHE_WORKER_BACKEND_CUDA_WEIGHT_KERNELS_H_
