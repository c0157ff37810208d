#include "common/health_service.h"

#include <atomic>
#include <cassert>

#include "absl/strings/str_cat.h"

namespace kvcache {

using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

// One Watch stream. It writes the service's current status whenever that
// differs from what it last wrote (one write in flight at a time), and ends with
// OK once the service has shut down and it has written NOT_SERVING.
//
// References: gRPC's, released in OnDone, and one per NotifyAll in progress, so
// that a notification never touches a deleted watcher. Lock order: a watcher's
// mu_, then the service's.
class HealthService::Watcher final : public grpc::ServerWriteReactor<HealthCheckResponse> {
 public:
  Watcher(HealthService* service, std::string name) : service_(service), name_(std::move(name)) {}

  void Ref() { refs_.fetch_add(1, std::memory_order_relaxed); }
  void Unref() {
    if (refs_.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
  }

  // Writes the current status if it is new and no write is in flight.
  void Notify() {
    absl::MutexLock lock(&mu_);
    if (!writing_ && !finished_) NextLocked();
  }

  void OnWriteDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    if (finished_) return;
    if (!ok || cancelled_) {  // the client is gone
      FinishLocked(grpc::Status(grpc::StatusCode::CANCELLED, "watch cancelled"));
      return;
    }
    NextLocked();
  }

  void OnCancel() override {
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
    // With a write in flight, OnWriteDone finishes: one operation at a time.
    if (!writing_ && !finished_) FinishLocked(grpc::Status(grpc::StatusCode::CANCELLED, "watch cancelled"));
  }

  void OnDone() override {
    {
      absl::MutexLock lock(&service_->mu_);
      service_->watchers_.erase(this);
    }
    Unref();
  }

 private:
  void NextLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const auto [status, end] = service_->Current(name_);
    if (!wrote_ || status != sent_) {
      wrote_ = true;
      sent_ = status;
      response_.set_status(status);
      writing_ = true;
      StartWrite(&response_);
      return;
    }
    if (end) FinishLocked(grpc::Status::OK);
  }

  void FinishLocked(const grpc::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    finished_ = true;
    Finish(status);
  }

  HealthService* const service_;
  const std::string name_;
  std::atomic<int> refs_{1};  // gRPC's

  absl::Mutex mu_;
  HealthCheckResponse response_ ABSL_GUARDED_BY(mu_);
  ServingStatus sent_ ABSL_GUARDED_BY(mu_) = HealthCheckResponse::UNKNOWN;
  bool wrote_ ABSL_GUARDED_BY(mu_) = false;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

HealthService::~HealthService() {
  absl::MutexLock lock(&mu_);
  assert(watchers_.empty());
}

void HealthService::SetServingStatus(const std::string& service, bool serving) {
  std::vector<Watcher*> notify;
  {
    absl::MutexLock lock(&mu_);
    if (shutdown_) return;
    auto [it, added] = serving_.try_emplace(service, serving);
    if (!added && it->second == serving) return;
    it->second = serving;
    for (Watcher* w : watchers_) {
      w->Ref();
      notify.push_back(w);
    }
  }
  NotifyAll(notify);
}

void HealthService::Shutdown() {
  std::vector<Watcher*> notify;
  {
    absl::MutexLock lock(&mu_);
    if (shutdown_) return;
    shutdown_ = true;
    for (auto& [name, serving] : serving_) serving = false;
    for (Watcher* w : watchers_) {
      w->Ref();
      notify.push_back(w);
    }
  }
  NotifyAll(notify);
}

void HealthService::NotifyAll(const std::vector<Watcher*>& watchers) {
  for (Watcher* w : watchers) {
    w->Notify();
    w->Unref();
  }
}

std::pair<HealthService::ServingStatus, bool> HealthService::Current(const std::string& service) const {
  absl::MutexLock lock(&mu_);
  auto it = serving_.find(service);
  if (it == serving_.end()) return {HealthCheckResponse::SERVICE_UNKNOWN, shutdown_};
  return {it->second ? HealthCheckResponse::SERVING : HealthCheckResponse::NOT_SERVING, shutdown_};
}

size_t HealthService::watchers() const {
  absl::MutexLock lock(&mu_);
  return watchers_.size();
}

grpc::ServerUnaryReactor* HealthService::Check(grpc::CallbackServerContext* context,
                                               const HealthCheckRequest* request,
                                               HealthCheckResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  const auto [status, end] = Current(request->service());
  if (status == HealthCheckResponse::SERVICE_UNKNOWN) {
    reactor->Finish(grpc::Status(grpc::StatusCode::NOT_FOUND,
                                 absl::StrCat("unknown service '", request->service(), "'")));
  } else {
    response->set_status(status);
    reactor->Finish(grpc::Status::OK);
  }
  return reactor;
}

grpc::ServerWriteReactor<HealthCheckResponse>* HealthService::Watch(grpc::CallbackServerContext*,
                                                                    const HealthCheckRequest* request) {
  auto* w = new Watcher(this, request->service());
  {
    absl::MutexLock lock(&mu_);
    watchers_.insert(w);
    w->Ref();  // for the Notify below
  }
  NotifyAll({w});
  return w;
}

}  // namespace kvcache
