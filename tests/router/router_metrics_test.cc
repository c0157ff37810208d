#include "router/router_metrics.h"

#include <map>
#include <string>

#include "gtest/gtest.h"
#include "prometheus/registry.h"

namespace kvcache::router {
namespace {

// worker label -> value of kvcache_router_worker_up.
std::map<std::string, double> WorkerUp(prometheus::Registry& registry) {
  std::map<std::string, double> up;
  for (const prometheus::MetricFamily& f : registry.Collect()) {
    if (f.name != "kvcache_router_worker_up") continue;
    for (const prometheus::ClientMetric& m : f.metric) {
      for (const prometheus::ClientMetric::Label& l : m.label) {
        if (l.name == "worker") up[l.value] = m.gauge.value;
      }
    }
  }
  return up;
}

WorkerView View(const std::string& address, bool connected, bool draining) {
  WorkerView v;
  v.address = address;
  v.connected = connected;
  v.draining = draining;
  return v;
}

TEST(RouterMetricsTest, WorkerUpIsZeroForADownWorkerAndAbsentForOneThatDrainedAndLeft) {
  prometheus::Registry registry;
  RouterMetrics metrics(registry);
  metrics.SetWorkers({View("a:1", true, false), View("b:1", true, true), View("c:1", false, false),
                      View("d:1", false, true)});
  // Up (draining or not), down (an outage: the alert's case), drained and gone.
  EXPECT_EQ(WorkerUp(registry), (std::map<std::string, double>{{"a:1", 1}, {"b:1", 1}, {"c:1", 0}}));
  // The drained worker comes back (a restart under the same address): up again.
  metrics.SetWorkers({View("a:1", true, false), View("d:1", true, false)});
  EXPECT_EQ(WorkerUp(registry), (std::map<std::string, double>{{"a:1", 1}, {"d:1", 1}}));
}

// A pod DNS lists while it loads its model is not down: it joins the metric
// once the router first reaches it, and reads 0 only when lost after that.
TEST(RouterMetricsTest, AWorkerFoundByDnsJoinsWorkerUpOnceReached) {
  prometheus::Registry registry;
  RouterMetrics metrics(registry);
  WorkerView starting = View("e:1", false, false);
  starting.discovered = true;
  metrics.SetWorkers({View("a:1", true, false), starting});
  EXPECT_EQ(WorkerUp(registry), (std::map<std::string, double>{{"a:1", 1}}));
  starting.connected = starting.reached = true;
  metrics.SetWorkers({View("a:1", true, false), starting});
  EXPECT_EQ(WorkerUp(registry), (std::map<std::string, double>{{"a:1", 1}, {"e:1", 1}}));
  starting.connected = false;  // lost
  metrics.SetWorkers({View("a:1", true, false), starting});
  EXPECT_EQ(WorkerUp(registry), (std::map<std::string, double>{{"a:1", 1}, {"e:1", 0}}));
}

}  // namespace
}  // namespace kvcache::router
