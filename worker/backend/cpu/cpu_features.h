// Run-time CPU feature dispatch and thread count for the CPU kernels.
//
// The library is built for baseline x86-64; vector kernels are compiled per
// function with `__attribute__((target(...)))` and chosen at run time from the
// current kernel level. Every level has the scalar kernels as its reference,
// and tests force each level in turn with SetCpuKernelLevel().
//
// Thread-safety: the level and thread count are process-wide atomics. Setting
// them while kernels run on other threads is safe but those kernels may use
// either value; set them at start-up (or in tests) only.
#ifndef KVCACHE_WORKER_BACKEND_CPU_CPU_FEATURES_H_
#define KVCACHE_WORKER_BACKEND_CPU_CPU_FEATURES_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvcache::cpu {

enum class CpuKernelLevel : int {
  kScalar = 0,  // portable C++, the reference every vector kernel is tested against
  kAvx2 = 1,    // AVX2 + FMA + F16C (maddubs/madd integer dots)
  kAvx512 = 2,  // kAvx2 plus AVX-512 F/BW/VL/VNNI (vpdpbusd integer dots)
};

const char* CpuKernelLevelName(CpuKernelLevel level);

// The best level this CPU supports (cached after the first call).
CpuKernelLevel MaxSupportedCpuKernelLevel();

// Every level this CPU supports, ascending (always starts with kScalar).
std::vector<CpuKernelLevel> SupportedCpuKernelLevels();

// "scalar", "avx2", "avx512", or "auto" (the best this CPU supports).
// INVALID_ARGUMENT for any other name, and for a level this CPU lacks.
absl::StatusOr<CpuKernelLevel> ParseCpuKernelLevel(absl::string_view name);

// The level kernels use now; defaults to MaxSupportedCpuKernelLevel().
CpuKernelLevel GetCpuKernelLevel();

// Forces a level (tests, A/B measurements).
// INVALID_ARGUMENT when the CPU does not support `level`.
absl::Status SetCpuKernelLevel(CpuKernelLevel level);

// Threads each kernel call may use (the caller and ComputePool helpers). Defaults
// to the CPUs this process may run on (sched_getaffinity) at first use.
int NumThreads();

// REQUIRES: n >= 1. Values above the core count oversubscribe; don't.
void SetNumThreads(int n);

// Bytes of one instance of the L3 cache as the CPU reports it (glibc's
// sysconf(_SC_LEVEL3_CACHE_SIZE)), or 0 when it reports none.
int64_t L3CacheBytes();

}  // namespace kvcache::cpu

#endif  // KVCACHE_WORKER_BACKEND_CPU_CPU_FEATURES_H_
