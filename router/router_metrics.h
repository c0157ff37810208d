// The router's Prometheus metrics (names as in deploy/metrics.txt).
//
// Thread-safety: prometheus-cpp metrics are thread-safe.
#ifndef KVCACHE_ROUTER_ROUTER_METRICS_H_
#define KVCACHE_ROUTER_ROUTER_METRICS_H_

#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "prometheus/counter.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "router/worker_pool.h"

namespace kvcache::router {

class RouterMetrics {
 public:
  explicit RouterMetrics(prometheus::Registry& registry);

  void OnDecision(const char* reason) { decisions_.Add({{"reason", reason}}).Increment(); }
  void OnRequestDone(const std::string& code) { requests_.Add({{"code", code}}).Increment(); }
  void OnCachedTokens(int64_t predicted, int64_t actual) {
    predicted_->Increment(static_cast<double>(predicted));
    actual_->Increment(static_cast<double>(actual));
  }
  void OnFirstToken(double seconds) { ttft_->Observe(seconds); }
  void OnRetry() { retries_->Increment(); }
  void OnMigration(const char* reason) { migrations_.Add({{"reason", reason}}).Increment(); }
  void OnDnsResult(const char* result) { dns_.Add({{"result", result}}).Increment(); }
  // Mirrors worker health into kvcache_router_worker_up{worker}.
  void SetWorkers(const std::vector<WorkerView>& workers);
  // Copies of sessions held back as stale (Directory::stale_copies).
  void SetStaleCopies(size_t n) { stale_copies_->Set(static_cast<double>(n)); }
  // Advances kvcache_router_sessions_lost_total to `total` (Directory::sessions_lost).
  void SetSessionsLost(uint64_t total);

 private:
  prometheus::Family<prometheus::Counter>& requests_;
  prometheus::Family<prometheus::Counter>& decisions_;
  prometheus::Counter* predicted_;
  prometheus::Counter* actual_;
  prometheus::Family<prometheus::Gauge>& worker_up_;
  prometheus::Histogram* ttft_;
  prometheus::Counter* retries_;
  prometheus::Family<prometheus::Counter>& migrations_;
  prometheus::Family<prometheus::Counter>& dns_;
  prometheus::Gauge* stale_copies_;
  prometheus::Counter* sessions_lost_;
  absl::Mutex mu_;  // SetWorkers runs on the rebalancer and on scrapes
  absl::flat_hash_map<std::string, prometheus::Gauge*> up_series_ ABSL_GUARDED_BY(mu_);
  uint64_t sessions_lost_seen_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvcache::router

#endif  // KVCACHE_ROUTER_ROUTER_METRICS_H_
