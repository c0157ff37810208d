// A weight matrix as the model layer binds it: a view into the GGUF file's
// memory map in its stored (possibly quantised) type. The backends multiply
// against it (worker/backend/cpu/matmul.h) or upload it (the CUDA plugin).
//
// Thread-safety: a plain value; the bytes it points to are immutable.
#ifndef KVCACHE_WORKER_MODEL_WEIGHT_VIEW_H_
#define KVCACHE_WORKER_MODEL_WEIGHT_VIEW_H_

#include <cstdint>

#include "common/gguf/ggml_types.h"

namespace kvcache::model {

// Rows are `RowBytes(type, cols)` apart (GGUF layout).
struct WeightView {
  gguf::GgmlType type = gguf::GgmlType::kF32;
  const void* data = nullptr;
  int64_t rows = 0;  // output features (ggml ne1)
  int64_t cols = 0;  // input features (ggml ne0, contiguous)
};

}  // namespace kvcache::model

#endif  // KVCACHE_WORKER_MODEL_WEIGHT_VIEW_H_
