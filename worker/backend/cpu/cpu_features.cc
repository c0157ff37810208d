#include "worker/backend/cpu/cpu_features.h"

#include <cpuid.h>
#include <sched.h>
#include <unistd.h>

#include <atomic>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"

namespace kvcache::cpu {
namespace {

// CPUID.1:ECX bit 29. Read directly: clang 14's __builtin_cpu_supports lacks "f16c".
bool HasF16c() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
}

CpuKernelLevel DetectLevel() {
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && HasF16c();
  if (!avx2) return CpuKernelLevel::kScalar;
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  return avx512 ? CpuKernelLevel::kAvx512 : CpuKernelLevel::kAvx2;
}

// -1 = not yet chosen (resolved lazily so static initialisation order never matters).
std::atomic<int> g_level{-1};
std::atomic<int> g_threads{0};

}  // namespace

const char* CpuKernelLevelName(CpuKernelLevel level) {
  switch (level) {
    case CpuKernelLevel::kScalar:
      return "scalar";
    case CpuKernelLevel::kAvx2:
      return "avx2";
    case CpuKernelLevel::kAvx512:
      return "avx512";
  }
  return "unknown";
}

CpuKernelLevel MaxSupportedCpuKernelLevel() {
  static const CpuKernelLevel kMax = DetectLevel();
  return kMax;
}

std::vector<CpuKernelLevel> SupportedCpuKernelLevels() {
  std::vector<CpuKernelLevel> out;
  for (int l = 0; l <= static_cast<int>(MaxSupportedCpuKernelLevel()); ++l) {
    out.push_back(static_cast<CpuKernelLevel>(l));
  }
  return out;
}

absl::StatusOr<CpuKernelLevel> ParseCpuKernelLevel(absl::string_view name) {
  if (name == "auto") return MaxSupportedCpuKernelLevel();
  for (CpuKernelLevel level : {CpuKernelLevel::kScalar, CpuKernelLevel::kAvx2, CpuKernelLevel::kAvx512}) {
    if (name != CpuKernelLevelName(level)) continue;
    if (static_cast<int>(level) > static_cast<int>(MaxSupportedCpuKernelLevel())) {
      return absl::InvalidArgumentError(absl::StrCat("cpu kernel level ", name,
                                                     " is not supported by this CPU (it has up to ",
                                                     CpuKernelLevelName(MaxSupportedCpuKernelLevel()), ")"));
    }
    return level;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("cpu kernel level '", name, "': want auto, avx512, avx2 or scalar"));
}

CpuKernelLevel GetCpuKernelLevel() {
  int l = g_level.load(std::memory_order_relaxed);
  if (l < 0) {
    l = static_cast<int>(MaxSupportedCpuKernelLevel());
    g_level.store(l, std::memory_order_relaxed);
  }
  return static_cast<CpuKernelLevel>(l);
}

absl::Status SetCpuKernelLevel(CpuKernelLevel level) {
  if (static_cast<int>(level) < 0 ||
      static_cast<int>(level) > static_cast<int>(MaxSupportedCpuKernelLevel())) {
    return absl::InvalidArgumentError(absl::StrCat("cpu kernel level ", CpuKernelLevelName(level),
                                                   " not supported; max is ",
                                                   CpuKernelLevelName(MaxSupportedCpuKernelLevel())));
  }
  g_level.store(static_cast<int>(level), std::memory_order_relaxed);
  return absl::OkStatus();
}

int NumThreads() {
  int n = g_threads.load(std::memory_order_relaxed);
  if (n <= 0) {
    cpu_set_t set;
    n = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
    if (n < 1) n = 1;
    g_threads.store(n, std::memory_order_relaxed);
  }
  return n;
}

void SetNumThreads(int n) { g_threads.store(n < 1 ? 1 : n, std::memory_order_relaxed); }

int64_t L3CacheBytesFromSysfs(const std::string& cpu_dir) {
  for (int i = 0; i < 16; ++i) {
    const std::string index = absl::StrCat(cpu_dir, "/cache/index", i);
    std::ifstream level_file(index + "/level");
    int level = 0;
    if (!(level_file >> level)) continue;  // no such entry (indices need not be dense)
    if (level != 3) continue;
    std::ifstream size_file(index + "/size");
    int64_t n = 0;
    std::string unit;
    if (!(size_file >> n) || n <= 0) return 0;
    size_file >> unit;  // the kernel writes "<n>K"; accept M and G too
    const int64_t scale = unit.empty()  ? 1
                          : unit == "K" ? 1024
                          : unit == "M" ? 1 << 20
                          : unit == "G" ? 1 << 30
                                        : 0;
    return n * scale;
  }
  return 0;
}

int64_t L3CacheBytes() {
  static const int64_t kBytes = [] {
    const int cpu = sched_getcpu();
    const int64_t sysfs =
        L3CacheBytesFromSysfs(absl::StrCat("/sys/devices/system/cpu/cpu", cpu < 0 ? 0 : cpu));
    if (sysfs > 0) return sysfs;
    const long n = sysconf(_SC_LEVEL3_CACHE_SIZE);
    return n > 0 ? static_cast<int64_t>(n) : int64_t{0};
  }();
  return kBytes;
}

}  // namespace kvcache::cpu
