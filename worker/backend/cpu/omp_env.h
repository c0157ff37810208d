// Process-level OpenMP settings the CPU kernels need, applied from main().
//
// libgomp reads its environment once, when it loads. Its default wait (spin for
// ~3 ms, then sleep) makes every parallel region wait out a scheduler slice when
// other processes share the cores (steps measured 100x slower under
// contention); a purely passive wait instead puts the pool threads to sleep at
// the end of every region, and waking them costs tens of microseconds on a VM
// (a 4k-token decode attention, 30 regions, ran 4.7 ms instead of 2.7 ms). So
// the worker and the benchmarks run with OMP_WAIT_POLICY=passive and a short
// spin, GOMP_SPINCOUNT=2000 (~20 us): back-to-back regions of a step find the
// threads awake, an idle or contended process gives its cores up quickly.
// libgomp cuts the spin to ~100 iterations when more of its threads exist than
// CPUs (two threads that each run parallel regions), so the kernels should run
// on one thread per process, as the worker's engine does.
//
// Since the variables must be set before libgomp loads, the only way to set
// them from inside the process is to re-exec it.
//
// Thread-safety: call once, first thing in main(), before any other thread exists.
#ifndef KVCACHE_WORKER_BACKEND_CPU_OMP_ENV_H_
#define KVCACHE_WORKER_BACKEND_CPU_OMP_ENV_H_

namespace kvcache::cpu {

// When OMP_WAIT_POLICY or GOMP_SPINCOUNT is unset, sets it (to "passive",
// "2000") and re-execs /proc/self/exe with `argv` (does not return on success).
// Values the caller already chose are kept. When the exec fails, returns and
// the process carries on as it is. Returns the wait policy in effect ("" when
// unset after a failed exec).
const char* EnsureOmpWaitSettings(char** argv);

}  // namespace kvcache::cpu

#endif  // KVCACHE_WORKER_BACKEND_CPU_OMP_ENV_H_
