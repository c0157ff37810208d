#include "router/router_metrics.h"

namespace kvcache::router {

RouterMetrics::RouterMetrics(prometheus::Registry& r)
    : requests_(prometheus::BuildCounter()
                    .Name("kvcache_router_requests_total")
                    .Help("Generate requests by final gRPC code")
                    .Register(r)),
      decisions_(prometheus::BuildCounter()
                     .Name("kvcache_router_decisions_total")
                     .Help("Placement decisions by reason (affinity, prefix, load, retry)")
                     .Register(r)),
      predicted_(&prometheus::BuildCounter()
                      .Name("kvcache_router_predicted_cached_tokens_total")
                      .Help("Cached tokens the router expected the chosen worker to reuse")
                      .Register(r)
                      .Add({})),
      actual_(&prometheus::BuildCounter()
                   .Name("kvcache_router_actual_cached_tokens_total")
                   .Help("Cached tokens the workers reported reusing")
                   .Register(r)
                   .Add({})),
      worker_up_(
          prometheus::BuildGauge()
              .Name("kvcache_router_worker_up")
              .Help(
                  "1 while the router reaches the worker (its Watch stream is live), draining or not; else 0 "
                  "(a worker found by DNS joins once first reached)")
              .Register(r)),
      ttft_(&prometheus::BuildHistogram()
                 .Name("kvcache_router_time_to_first_token_seconds")
                 .Help("Request receipt at the router to first token out")
                 .Register(r)
                 .Add({}, prometheus::Histogram::BucketBoundaries{0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                                                  0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30})),
      retries_(&prometheus::BuildCounter()
                    .Name("kvcache_router_retries_total")
                    .Help("Requests resent to another worker")
                    .Register(r)
                    .Add({})),
      migrations_(prometheus::BuildCounter()
                      .Name("kvcache_router_migrations_total")
                      .Help("Session migrations the router started, by reason")
                      .Register(r)),
      dns_(prometheus::BuildCounter()
               .Name("kvcache_router_dns_resolutions_total")
               .Help("DNS lookups of --worker_dns names by result (ok, empty, failed); empty and failed "
                     "ones keep the last good workers")
               .Register(r)),
      stale_copies_(
          &prometheus::BuildGauge()
               .Name("kvcache_router_stale_session_copies")
               .Help("Session copies held back: ones a FULL_CONTEXT turn moved off a worker out of reach, "
                     "and the sessions of workers forgotten as unreachable")
               .Register(r)
               .Add({})),
      sessions_lost_(&prometheus::BuildCounter()
                          .Name("kvcache_router_sessions_lost_total")
                          .Help("Sessions lost with their worker (forgotten as unreachable, or back without "
                                "them) that no other worker held: their clients must resend the whole "
                                "conversation")
                          .Register(r)
                          .Add({})) {}

void RouterMetrics::SetSessionsLost(uint64_t total) {
  absl::MutexLock lock(&mu_);
  if (total <= sessions_lost_seen_) return;
  sessions_lost_->Increment(static_cast<double>(total - sessions_lost_seen_));
  sessions_lost_seen_ = total;
}

void RouterMetrics::SetWorkers(const std::vector<WorkerView>& workers) {
  absl::MutexLock lock(&mu_);
  absl::flat_hash_map<std::string, prometheus::Gauge*> now;
  for (const WorkerView& w : workers) {
    // Up while reachable: a draining worker is up (it is handing its sessions
    // over). One that drained and went away (a static --workers entry stays in
    // the pool) left on purpose: it leaves the metric, as a dropped worker does,
    // instead of reading 0 (down) until it comes back.
    if (!w.connected && w.draining) continue;
    // A worker DNS lists that the router has never reached is starting: the
    // headless Service publishes pods that are not ready (so that draining ones
    // stay reachable), and a pod loading its model is one. It joins the metric
    // once reached, instead of reading 0 (down, a critical alert) while it
    // loads. A static --workers entry is expected up from the start.
    if (w.discovered && !w.reached) continue;
    prometheus::Gauge* g = &worker_up_.Add({{"worker", w.address}});
    g->Set(w.connected ? 1 : 0);
    now[w.address] = g;
  }
  // A worker that left the pool leaves the metric too, instead of reading 0 forever.
  for (const auto& [address, g] : up_series_) {
    if (!now.contains(address)) worker_up_.Remove(g);
  }
  up_series_ = std::move(now);
}

}  // namespace kvcache::router
