// How much memory this process may use: its cgroup's limit (what a Kubernetes
// container's `resources.limits.memory` sets, enforced by the OOM killer) and
// the machine's RAM. The worker checks its KV budgets against them at start, so
// that a budget the container cannot hold fails there, with a message, instead of
// at peak load, where the OOM killer would take every session with it.
#ifndef KVCACHE_COMMON_MEMORY_LIMIT_H_
#define KVCACHE_COMMON_MEMORY_LIMIT_H_

#include <cstdint>
#include <optional>
#include <string>

namespace kvcache {

struct CgroupLimit {
  int64_t bytes = 0;
  std::string file;  // where it was read, for messages
};

// The least memory limit of this process's cgroup and its ancestors: cgroup v2
// `memory.max`, or v1 `memory.limit_in_bytes` when the memory controller is on a
// v1 hierarchy. `proc_cgroup` is the text of /proc/self/cgroup and `root` the
// cgroup mount (/sys/fs/cgroup); a cgroup directory that is not mounted there (a
// container sees its own cgroup at the root) is skipped. nullopt when no limit
// is set or nothing can be read.
std::optional<CgroupLimit> CgroupMemoryLimit(const std::string& proc_cgroup, const std::string& root);

// The same for this process (/proc/self/cgroup, /sys/fs/cgroup).
std::optional<CgroupLimit> ProcessMemoryLimit();

// MemTotal of /proc/meminfo in bytes, or nullopt.
std::optional<int64_t> PhysicalMemoryBytes();

// A worker's process memory beside its KV tiers and one copy of the model's
// weights, with room for activations and gRPC buffers. A SmolLM2 worker with 16
// MiB of tier 0 measured 233 MiB of RSS at start: 120 MiB anonymous (94 MiB of it
// the re-laid weights) and 113 MiB of mapped files (the model, which the kernel
// can reclaim, and the libraries).
inline constexpr int64_t kWorkerProcessBytes = int64_t{256} << 20;

// Host memory a worker needs: `host_tier0` (tier 0 on the CPU backend, else 0),
// `tier1`, `weights` (the model file) and kWorkerProcessBytes. Saturates at
// INT64_MAX (the budget flags have no upper bound).
int64_t WorkerHostBytes(int64_t host_tier0, int64_t tier1, int64_t weights);

}  // namespace kvcache

#endif  // KVCACHE_COMMON_MEMORY_LIMIT_H_
