// RopeCosSinTable (norm_rope.h): host code, kept out of the .cu files so that
// nvcc never sees the model headers.
#include "worker/backend/cuda/norm_rope.h"
#include "worker/model/rope.h"

namespace kvcache::cuda {

void RopeCosSinTable(const model::RopeParams& params, int max_positions, float* out) {
  const int half = params.head_dim / 2;
  for (int p = 0; p < max_positions; ++p) {
    for (int i = 0; i < half; ++i) {
      const model::RopeAngle a = model::RopeAt(params, p, i);
      out[(int64_t{p} * half + i) * 2] = static_cast<float>(a.cos);
      out[(int64_t{p} * half + i) * 2 + 1] = static_cast<float>(a.sin);
    }
  }
}

}  // namespace kvcache::cuda
