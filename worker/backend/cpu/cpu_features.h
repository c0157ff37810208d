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
#include <string>
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

// Bytes of the L3 cache that the CPU this process first asks from shares with
// its neighbours, as Linux reports it (sysfs, what lscpu shows: see
// L3CacheBytesFromSysfs), else glibc's sysconf(_SC_LEVEL3_CACHE_SIZE); 0 when
// neither reports one. glibc derives its figure from CPUID, which on AMD EPYC VMs
// gives the whole socket's L3 (seen: 256 MiB on a Zen 3 whose cores share 32 MiB).
int64_t L3CacheBytes();

// The size of the level-3 cache among cpu_dir's cache/index<i> entries (cpu_dir
// like /sys/devices/system/cpu/cpu0; each entry's `level` and `size`, "32768K"),
// or 0 when there is none or it cannot be read.
int64_t L3CacheBytesFromSysfs(const std::string& cpu_dir);

}  // namespace kvcache::cpu

#endif  // KVCACHE_WORKER_BACKEND_CPU_CPU_FEATURES_H_
