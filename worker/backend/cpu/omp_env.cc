#include "worker/backend/cpu/omp_env.h"

#include <unistd.h>

#include <cstdlib>

namespace kvcache::cpu {

const char* EnsureOmpWaitSettings(char** argv) {
  bool changed = false;
  if (std::getenv("OMP_WAIT_POLICY") == nullptr) {
    setenv("OMP_WAIT_POLICY", "passive", 1);
    changed = true;
  }
  if (std::getenv("GOMP_SPINCOUNT") == nullptr) {
    setenv("GOMP_SPINCOUNT", "2000", 1);
    changed = true;
  }
  if (changed) execv("/proc/self/exe", argv);  // returns only on failure: carry on as we are
  const char* policy = std::getenv("OMP_WAIT_POLICY");
  return policy != nullptr ? policy : "";
}

}  // namespace kvcache::cpu
