// grpc.health.v1.Health for a ServerProcess: Check and Watch of the statuses the
// process sets per service name ("" for the whole server).
//
// gRPC's default health service never ends a Watch stream: a stopping server
// waited its whole shutdown deadline for every open one (gRPC clients with
// client-side health checking hold one per connection; a router took 10 s to
// stop instead of 20 ms). Shutdown here sends each watcher NOT_SERVING, then
// ends its stream with OK.
//
//   HealthService health;
//   builder.RegisterService(&health);
//   health.SetServingStatus("readiness", true);
//   ...
//   health.Shutdown();  // before grpc::Server::Shutdown
//
// Check: the service's status, NOT_FOUND for a name never set. Watch: the
// current status at once (SERVICE_UNKNOWN for a name never set), then each
// change; a watcher that falls behind gets the latest status, not every one.
//
// Thread-safety: every method may be called from any thread.
#ifndef KVCACHE_COMMON_HEALTH_SERVICE_H_
#define KVCACHE_COMMON_HEALTH_SERVICE_H_

#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace kvcache {

class HealthService final : public grpc::health::v1::Health::CallbackService {
 public:
  using ServingStatus = grpc::health::v1::HealthCheckResponse::ServingStatus;

  HealthService() = default;
  // REQUIRES: the server that served it has shut down (every call has ended).
  ~HealthService() override;
  HealthService(const HealthService&) = delete;
  HealthService& operator=(const HealthService&) = delete;

  // Ignored after Shutdown.
  void SetServingStatus(const std::string& service, bool serving);
  // Every service NOT_SERVING from now on, and every Watch stream ended (OK) once
  // it has sent that; Watch calls that start later end the same way.
  void Shutdown();

  grpc::ServerUnaryReactor* Check(grpc::CallbackServerContext* context,
                                  const grpc::health::v1::HealthCheckRequest* request,
                                  grpc::health::v1::HealthCheckResponse* response) override;
  grpc::ServerWriteReactor<grpc::health::v1::HealthCheckResponse>* Watch(
      grpc::CallbackServerContext* context, const grpc::health::v1::HealthCheckRequest* request) override;

  // Watch streams open now (tests).
  size_t watchers() const;

 private:
  class Watcher;
  // The status a watcher of `service` should show now, and whether its stream
  // should end once it has.
  std::pair<ServingStatus, bool> Current(const std::string& service) const;
  // Tells `watchers` (each holding a reference the call releases) to catch up.
  static void NotifyAll(const std::vector<Watcher*>& watchers);

  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, bool> serving_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<Watcher*> watchers_ ABSL_GUARDED_BY(mu_);
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace kvcache

#endif  // KVCACHE_COMMON_HEALTH_SERVICE_H_
