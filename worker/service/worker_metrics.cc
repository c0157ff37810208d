#include "worker/service/worker_metrics.h"

namespace kvcache::service {
namespace {

using prometheus::BuildCounter;
using prometheus::BuildGauge;
using prometheus::BuildHistogram;
using prometheus::Histogram;

Histogram::BucketBoundaries LatencyBuckets() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60};
}

Histogram::BucketBoundaries SizeBuckets() { return {1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024}; }

const char* TierName(int t) { return t == 0 ? "device" : "host"; }

}  // namespace

void WorkerMetrics::SetInfo(const std::string& device, const std::string& cpu_kernel_level) {
  info_.Add({{"device", device}, {"cpu_kernel_level", cpu_kernel_level}}).Set(1);
}

WorkerMetrics::WorkerMetrics(prometheus::Registry& r)
    : pages_(BuildGauge().Name("kvcache_kv_pages").Help("KV pages by tier and state").Register(r)),
      usage_(BuildGauge()
                 .Name("kvcache_kv_usage_ratio")
                 .Help("KV pages held by sessions and steps / capacity, by tier (unreferenced prefix-cache "
                       "pages are free to take)")
                 .Register(r)),
      capacity_bytes_(
          BuildGauge().Name("kvcache_kv_capacity_bytes").Help("KV page budget in bytes by tier").Register(r)),
      waste_(&BuildGauge()
                  .Name("kvcache_kv_waste_token_slots")
                  .Help("Allocated minus used token slots of session pages")
                  .Register(r)
                  .Add({})),
      sessions_(BuildGauge().Name("kvcache_sessions").Help("Sessions by state").Register(r)),
      running_(&BuildGauge()
                    .Name("kvcache_requests_running")
                    .Help("Requests in engine steps")
                    .Register(r)
                    .Add({})),
      waiting_(&BuildGauge().Name("kvcache_requests_waiting").Help("Requests queued").Register(r).Add({})),
      draining_(&BuildGauge().Name("kvcache_worker_draining").Help("1 while draining").Register(r).Add({})),
      info_(BuildGauge()
                .Name("kvcache_worker_info")
                .Help("1, labelled with the backend device and the CPU kernel level this worker runs")
                .Register(r)),
      prefix_query_(&BuildCounter()
                         .Name("kvcache_prefix_query_tokens_total")
                         .Help("Prompt tokens looked up in the prefix cache")
                         .Register(r)
                         .Add({})),
      prefix_hit_(&BuildCounter()
                       .Name("kvcache_prefix_hit_tokens_total")
                       .Help("Prompt tokens served from cached prefix pages")
                       .Register(r)
                       .Add({})),
      offload_bytes_(&BuildCounter()
                          .Name("kvcache_offload_bytes_total")
                          .Help("Bytes moved from tier 0 to tier 1")
                          .Register(r)
                          .Add({})),
      restore_bytes_(&BuildCounter()
                          .Name("kvcache_restore_bytes_total")
                          .Help("Bytes moved from tier 1 to tier 0")
                          .Register(r)
                          .Add({})),
      preemptions_(&BuildCounter()
                        .Name("kvcache_preemptions_total")
                        .Help("Running sessions offloaded to make room")
                        .Register(r)
                        .Add({})),
      step_part_seconds_(BuildCounter()
                             .Name("kvcache_step_part_seconds_total")
                             .Help("Seconds of engine steps in the runner's forward pass (part=forward) and, "
                                   "within it, in the linear layers' products and in attention (0 where the "
                                   "runner does not time them apart)")
                             .Register(r)),
      step_forward_seconds_(&step_part_seconds_.Add({{"part", "forward"}})),
      step_products_seconds_(&step_part_seconds_.Add({{"part", "products"}})),
      step_attention_seconds_(&step_part_seconds_.Add({{"part", "attention"}})),
      recomputed_tokens_(
          &BuildCounter()
               .Name("kvcache_recomputed_tokens_total")
               .Help("Tokens whose K/V a running request lost under memory pressure and computed "
                     "again (same tokens, more time)")
               .Register(r)
               .Add({})),
      prefill_tokens_(&BuildCounter()
                           .Name("kvcache_prefill_tokens_total")
                           .Help("Prompt tokens computed by prefill (what the cache did not serve), "
                                 "recomputed ones included")
                           .Register(r)
                           .Add({})),
      unauthenticated_(&BuildCounter()
                            .Name("kvcache_worker_unauthenticated_calls_total")
                            .Help("Calls refused because the caller is not a peer of the fleet (wrong "
                                  "or missing cluster token)")
                            .Register(r)
                            .Add({})),
      sessions_expired_(&BuildCounter()
                             .Name("kvcache_sessions_expired_total")
                             .Help("Named sessions closed after --session_idle_ttl without a request")
                             .Register(r)
                             .Add({})),
      migration_bytes_(BuildCounter()
                           .Name("kvcache_migration_bytes_total")
                           .Help("Session bytes migrated, by direction")
                           .Register(r)),
      requests_(
          BuildCounter().Name("kvcache_requests_total").Help("Generate requests by gRPC code").Register(r)),
      prompt_tokens_(&BuildCounter()
                          .Name("kvcache_prompt_tokens_total")
                          .Help("Context tokens of finished requests (cached + prefilled)")
                          .Register(r)
                          .Add({})),
      cached_tokens_(&BuildCounter()
                          .Name("kvcache_cached_tokens_total")
                          .Help("Context tokens served from cache instead of prefill")
                          .Register(r)
                          .Add({})),
      generated_tokens_(&BuildCounter()
                             .Name("kvcache_generated_tokens_total")
                             .Help("Tokens generated")
                             .Register(r)
                             .Add({})),
      ttft_(&BuildHistogram()
                 .Name("kvcache_time_to_first_token_seconds")
                 .Help("Receipt to first token")
                 .Register(r)
                 .Add({}, LatencyBuckets())),
      inter_token_(&BuildHistogram()
                        .Name("kvcache_inter_token_latency_seconds")
                        .Help("Time between consecutive tokens of a stream")
                        .Register(r)
                        .Add({}, LatencyBuckets())),
      duration_(&BuildHistogram()
                     .Name("kvcache_request_duration_seconds")
                     .Help("Receipt to final message")
                     .Register(r)
                     .Add({}, LatencyBuckets())),
      step_(&BuildHistogram()
                 .Name("kvcache_step_duration_seconds")
                 .Help("Engine step wall time")
                 .Register(r)
                 .Add({}, LatencyBuckets())),
      batch_size_(&BuildHistogram()
                       .Name("kvcache_batch_size")
                       .Help("Sequences per engine step")
                       .Register(r)
                       .Add({}, SizeBuckets())),
      batch_tokens_(&BuildHistogram()
                         .Name("kvcache_batch_tokens")
                         .Help("New tokens per engine step")
                         .Register(r)
                         .Add({}, SizeBuckets())),
      offload_seconds_(&BuildHistogram()
                            .Name("kvcache_offload_duration_seconds")
                            .Help("Explicit session offload time")
                            .Register(r)
                            .Add({}, LatencyBuckets())),
      restore_seconds_(&BuildHistogram()
                            .Name("kvcache_restore_duration_seconds")
                            .Help("Explicit session restore time")
                            .Register(r)
                            .Add({}, LatencyBuckets())),
      migration_seconds_(&BuildHistogram()
                              .Name("kvcache_migration_duration_seconds")
                              .Help("Whole session migration time")
                              .Register(r)
                              .Add({}, LatencyBuckets())) {}

void WorkerMetrics::Refresh(const kv::KvStats& kv, int64_t page_bytes, const sched::EngineLoad& load,
                            bool draining) {
  for (int t = 0; t < 2; ++t) {
    const kv::TierStats& ts = kv.tier[t];
    const char* tier = TierName(t);
    pages_.Add({{"tier", tier}, {"state", "free"}}).Set(static_cast<double>(ts.free_pages));
    pages_.Add({{"tier", tier}, {"state", "private"}}).Set(static_cast<double>(ts.session_private_pages));
    pages_.Add({{"tier", tier}, {"state", "shared"}}).Set(static_cast<double>(ts.prefix_shared_pages));
    pages_.Add({{"tier", tier}, {"state", "cached"}}).Set(static_cast<double>(ts.cached_unreferenced_pages));
    pages_.Add({{"tier", tier}, {"state", "in_flight"}}).Set(static_cast<double>(ts.in_flight_pages));
    // Pages the prefix cache keeps without a session referencing them are given
    // back on demand (LRU), so they do not count as used: an idle worker after a
    // burst is not full (KvCacheDeviceCacheFull would fire on it).
    const double used = static_cast<double>(ts.capacity_pages - ts.free_pages - ts.cached_unreferenced_pages);
    usage_.Add({{"tier", tier}})
        .Set(ts.capacity_pages > 0 ? used / static_cast<double>(ts.capacity_pages) : 0);
    capacity_bytes_.Add({{"tier", tier}}).Set(static_cast<double>(ts.capacity_pages * page_bytes));
  }
  waste_->Set(static_cast<double>(kv.waste_token_slots));
  const double offloaded = static_cast<double>(kv.offloaded_sessions);
  sessions_.Add({{"state", "running"}}).Set(load.running);
  sessions_.Add({{"state", "offloaded"}}).Set(offloaded);
  sessions_.Add({{"state", "idle"}})
      .Set(std::max(0.0, static_cast<double>(kv.sessions) - offloaded - load.running));
  running_->Set(load.running);
  waiting_->Set(load.waiting);
  draining_->Set(draining ? 1 : 0);
  absl::MutexLock lock(&mu_);
  auto bump = [](prometheus::Counter* c, int64_t now, int64_t before) {
    if (now > before) c->Increment(static_cast<double>(now - before));
  };
  bump(prefix_query_, kv.prefix_query_tokens, last_.prefix_query_tokens);
  bump(prefix_hit_, kv.prefix_hit_tokens, last_.prefix_hit_tokens);
  bump(offload_bytes_, kv.offload_bytes, last_.offload_bytes);
  bump(restore_bytes_, kv.restore_bytes, last_.restore_bytes);
  bump(preemptions_, kv.preemptions, last_.preemptions);
  bump(sessions_expired_, load.sessions_expired, last_expired_);
  last_ = kv;
  last_expired_ = load.sessions_expired;
}

void WorkerMetrics::OnStep(const sched::StepStats& step) {
  step_->Observe(absl::ToDoubleSeconds(step.duration));
  step_forward_seconds_->Increment(absl::ToDoubleSeconds(step.forward));
  step_products_seconds_->Increment(absl::ToDoubleSeconds(step.products));
  step_attention_seconds_->Increment(absl::ToDoubleSeconds(step.attention));
  batch_size_->Observe(step.sequences);
  batch_tokens_->Observe(step.decode_tokens + step.prefill_tokens);
  if (step.recomputed_tokens > 0) recomputed_tokens_->Increment(static_cast<double>(step.recomputed_tokens));
  if (step.prefill_tokens > 0) prefill_tokens_->Increment(static_cast<double>(step.prefill_tokens));
}

void WorkerMetrics::OnRequestDone(const std::string& code, const sched::GenerateResult* result) {
  requests_.Add({{"code", code}}).Increment();
  if (result == nullptr) return;
  prompt_tokens_->Increment(static_cast<double>(result->prompt_tokens));
  cached_tokens_->Increment(static_cast<double>(result->cached_tokens));
  generated_tokens_->Increment(static_cast<double>(result->generated_tokens));
  if (result->generated_tokens > 0) ttft_->Observe(absl::ToDoubleSeconds(result->time_to_first_token));
  duration_->Observe(absl::ToDoubleSeconds(result->total_time));
}

void WorkerMetrics::OnMigration(bool outgoing, int64_t bytes, absl::Duration d) {
  migration_bytes_.Add({{"direction", outgoing ? "out" : "in"}}).Increment(static_cast<double>(bytes));
  migration_seconds_->Observe(absl::ToDoubleSeconds(d));
}

}  // namespace kvcache::service
