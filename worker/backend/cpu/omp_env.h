// Process-level OpenMP settings the CPU kernels need, applied from main().
//
// libgomp reads OMP_WAIT_POLICY once, when it loads. Its default (spin for a
// while, then sleep) makes every parallel region wait out a scheduler slice when
// other processes share the cores (steps measured 100x slower under contention);
// `passive` is what the worker and the benchmarks run with. Since the variable
// must be set before libgomp loads, the only way to set it from inside the
// process is to re-exec it.
//
// Thread-safety: call once, first thing in main(), before any other thread exists.
#ifndef KVCACHE_WORKER_BACKEND_CPU_OMP_ENV_H_
#define KVCACHE_WORKER_BACKEND_CPU_OMP_ENV_H_

namespace kvcache::cpu {

// When OMP_WAIT_POLICY is unset, sets it to "passive" and re-execs
// /proc/self/exe with `argv` (does not return on success). When the caller
// already chose a policy, or the exec fails, returns and the process carries on
// as it is. Returns the policy in effect ("" when unset after a failed exec).
const char* EnsurePassiveOmpWaitPolicy(char** argv);

}  // namespace kvcache::cpu

#endif  // KVCACHE_WORKER_BACKEND_CPU_OMP_ENV_H_
