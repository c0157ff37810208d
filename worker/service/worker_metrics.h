// The worker's Prometheus metrics (names, units and labels as in
// deploy/README.md's metrics table). Gauges that mirror the KV cache and the
// engine are refreshed by Refresh(); counters and histograms are updated as
// things happen.
//
// Thread-safety: prometheus-cpp metrics are thread-safe; Refresh may run on any
// thread.
#ifndef KVCACHE_WORKER_SERVICE_WORKER_METRICS_H_
#define KVCACHE_WORKER_SERVICE_WORKER_METRICS_H_

#include <string>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "worker/kv/kv_stats.h"
#include "worker/sched/engine.h"

namespace kvcache::service {

class WorkerMetrics {
 public:
  explicit WorkerMetrics(prometheus::Registry& registry);

  // Mirrors the cache's page and session counts, byte counters and the engine's
  // queue into gauges and counters.
  void Refresh(const kv::KvStats& kv, int64_t page_bytes, const sched::EngineLoad& load, bool draining);

  void OnStep(const sched::StepStats& step);
  void OnRequestDone(const std::string& code, const sched::GenerateResult* result);
  void OnInterTokenLatency(absl::Duration d) { inter_token_->Observe(absl::ToDoubleSeconds(d)); }
  void OnMigration(bool outgoing, int64_t bytes, absl::Duration d);
  void OnOffload(absl::Duration d) { offload_seconds_->Observe(absl::ToDoubleSeconds(d)); }
  void OnRestore(absl::Duration d) { restore_seconds_->Observe(absl::ToDoubleSeconds(d)); }
  void OnUnauthenticated() { unauthenticated_->Increment(); }
  // kvcache_worker_info{device, cpu_kernel_level} = 1: what this process runs
  // on (set once at start-up).
  void SetInfo(const std::string& device, const std::string& cpu_kernel_level);

 private:
  prometheus::Family<prometheus::Gauge>& pages_;
  prometheus::Family<prometheus::Gauge>& usage_;
  prometheus::Family<prometheus::Gauge>& capacity_bytes_;
  prometheus::Gauge* waste_;
  prometheus::Family<prometheus::Gauge>& sessions_;
  prometheus::Gauge* running_;
  prometheus::Gauge* waiting_;
  prometheus::Gauge* draining_;
  prometheus::Family<prometheus::Gauge>& info_;
  prometheus::Counter* prefix_query_;
  prometheus::Counter* prefix_hit_;
  prometheus::Counter* offload_bytes_;
  prometheus::Counter* restore_bytes_;
  prometheus::Counter* preemptions_;
  // kvcache_step_part_seconds_total by part: the runner's forward pass, and the
  // products and attention within it.
  prometheus::Family<prometheus::Counter>& step_part_seconds_;
  prometheus::Counter* step_forward_seconds_;
  prometheus::Counter* step_products_seconds_;
  prometheus::Counter* step_attention_seconds_;
  prometheus::Counter* recomputed_tokens_;
  prometheus::Counter* prefill_tokens_;
  prometheus::Counter* unauthenticated_;
  prometheus::Counter* sessions_expired_;
  prometheus::Family<prometheus::Counter>& migration_bytes_;
  prometheus::Family<prometheus::Counter>& requests_;
  prometheus::Counter* prompt_tokens_;
  prometheus::Counter* cached_tokens_;
  prometheus::Counter* generated_tokens_;
  prometheus::Histogram* ttft_;
  prometheus::Histogram* inter_token_;
  prometheus::Histogram* duration_;
  prometheus::Histogram* step_;
  prometheus::Histogram* batch_size_;
  prometheus::Histogram* batch_tokens_;
  prometheus::Histogram* offload_seconds_;
  prometheus::Histogram* restore_seconds_;
  prometheus::Histogram* migration_seconds_;

  absl::Mutex mu_;
  kv::KvStats last_ ABSL_GUARDED_BY(mu_);  // counters already exported
  int64_t last_expired_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvcache::service

#endif  // KVCACHE_WORKER_SERVICE_WORKER_METRICS_H_
