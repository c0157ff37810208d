#include "router/worker_pool.h"

#include <netdb.h>
#include <pthread.h>
#include <sys/socket.h>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "router/watch_ingest.h"

namespace kvcache::router {

struct WorkerPool::Worker {
  std::string address;
  std::shared_ptr<grpc::Channel> channel;
  std::thread thread;
  absl::Notification stop;
  // Guarded by the pool's mutex.
  std::string worker_id;
  std::string model_id;
  v1::KvShape kv_shape;
  v1::WorkerLoad load;
  int64_t load_reports = 0;  // load reports received (snapshots included)
  bool connected = false;
  bool reached = false;  // connected at least once
  bool suspect = false;
  bool wrong_model = false;  // its snapshot named another model than options_.model_id
  std::string refusal;       // why it last refused this router's Watch (logged once), if it did
  bool admin_draining = false;
  absl::Time last_message = absl::InfinitePast();
  absl::Time disconnected_since = absl::Now();
  bool forgotten = false;
  bool departed = false;                  // a DNS-discovered worker no longer in its name's answer
  bool refused_draining = false;          // it answered new work with kWorkerDrainingMessage
  grpc::ClientContext* stream = nullptr;  // the open Watch call, to cancel it

  // Takes no new work: it announced a drain, an admin started one, or it
  // refused work as draining. Under the pool's mutex.
  bool draining() const { return admin_draining || load.draining() || refused_draining; }
};

WorkerPool::WorkerPool(WorkerPoolOptions options, Directory* directory)
    : options_(std::move(options)), directory_(directory) {
  health_ = std::thread([this] {
    const absl::Duration tick = std::max(absl::Milliseconds(50), options_.health_timeout / 4);
    while (!stop_.WaitForNotificationWithTimeout(tick)) {
      std::vector<WorkerId> forget;
      {
        absl::MutexLock lock(&mu_);
        const absl::Time now = absl::Now();
        for (auto& [addr, w] : workers_) {
          if (w->connected && now - w->last_message > options_.health_timeout && w->stream != nullptr) {
            KV_LOG_WARN("worker {} silent for {}; reconnecting", addr,
                        absl::FormatDuration(now - w->last_message));
            w->stream->TryCancel();
          }
          if (!w->connected && !w->forgotten && now - w->disconnected_since > options_.forget_after) {
            w->forgotten = true;
            forget.push_back(addr);
          }
        }
      }
      for (const WorkerId& addr : forget) {
        // Unreachable, maybe not gone: what it holds may come back stale.
        auto lost = directory_->RemoveWorker(addr, /*may_return=*/true);
        KV_LOG_WARN("worker {} unreachable for {}: forgetting it and {} sessions", addr,
                    absl::FormatDuration(options_.forget_after), lost.size());
      }
      ReapDeparted();
    }
  });
}

WorkerPool::~WorkerPool() { Stop(); }

void WorkerPool::Stop() {
  std::vector<std::unique_ptr<Worker>> all;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
    for (auto& [addr, w] : workers_) {
      w->stop.Notify();
      if (w->stream != nullptr) w->stream->TryCancel();
      all.push_back(std::move(w));
    }
    workers_.clear();
  }
  stop_.Notify();
  for (auto& w : all) {
    if (w->thread.joinable()) w->thread.join();
  }
  if (resolver_.joinable()) resolver_.join();
  if (health_.joinable()) health_.join();
}

void WorkerPool::AddLocked(const std::string& address) {
  if (workers_.contains(address) || stopping_) return;
  auto w = std::make_unique<Worker>();
  w->address = address;
  // A worker that is not up yet (a pod loading its model) is reached within a
  // second of serving, not after gRPC's exponential reconnect back-off, which
  // had grown to 12-28 s over a two-minute start.
  grpc::ChannelArguments args = options_.channel_args;
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  w->channel = options_.cluster_token.NewChannel(
      address, options_.credentials ? options_.credentials : grpc::InsecureChannelCredentials(), args);
  Worker* raw = w.get();
  workers_[address] = std::move(w);
  raw->thread = std::thread([this, raw] {
    pthread_setname_np(pthread_self(), "kv-watch");  // one per worker: visible in top -H and tests
    Watch(raw);
  });
  KV_LOG_INFO("watching worker {}", address);
}

void WorkerPool::Retire(std::vector<std::unique_ptr<Worker>> retired) {
  // Join first: a Watch thread still running could apply one more snapshot for
  // the worker after the directory forgot it.
  for (auto& w : retired) {
    if (w->thread.joinable()) w->thread.join();
  }
  for (auto& w : retired) directory_->RemoveWorker(w->address);
}

void WorkerPool::SetAddresses(const std::vector<std::string>& addresses) {
  std::vector<std::unique_ptr<Worker>> retired;
  {
    absl::MutexLock lock(&mu_);
    absl::flat_hash_set<std::string> keep(addresses.begin(), addresses.end());
    for (const auto& a : addresses) {
      static_[a] = true;
      AddLocked(a);
    }
    for (auto it = workers_.begin(); it != workers_.end();) {
      if (!keep.contains(it->first) && static_.contains(it->first)) {
        it->second->stop.Notify();
        if (it->second->stream != nullptr) it->second->stream->TryCancel();
        static_.erase(it->first);
        retired.push_back(std::move(it->second));
        workers_.erase(it++);
      } else {
        ++it;
      }
    }
  }
  Retire(std::move(retired));
}

absl::Status WorkerPool::AddDnsName(const std::string& name) {
  auto target = ParseDnsTarget(name);
  if (!target.ok()) return target.status();
  {
    absl::MutexLock lock(&mu_);
    dns_targets_.push_back(*target);
  }
  Resolve();
  if (!resolver_.joinable()) {
    resolver_ = std::thread([this] {
      while (!stop_.WaitForNotificationWithTimeout(options_.dns_refresh)) Resolve();
    });
  }
  return absl::OkStatus();
}

void WorkerPool::Resolve() {
  std::vector<DnsTarget> targets;
  {
    absl::MutexLock lock(&mu_);
    targets = dns_targets_;
  }
  std::vector<std::pair<std::string, DnsAnswer>> answers;
  for (const DnsTarget& t : targets) {
    DnsAnswer a = router::Resolve(t);
    if (options_.on_dns_result) options_.on_dns_result(DnsResultName(a.result));
    answers.emplace_back(t.spec, std::move(a));
  }
  {
    absl::MutexLock lock(&mu_);
    for (auto& [spec, a] : answers) {
      if (a.result == DnsAnswer::Result::kOk) {
        dns_last_good_[spec] = std::move(a.addresses);
        continue;
      }
      // An outage or a half-updated zone must not empty the fleet: keep the
      // last answer that held addresses.
      const size_t kept = dns_last_good_.contains(spec) ? dns_last_good_[spec].size() : 0;
      if (a.result == DnsAnswer::Result::kFailed) {
        KV_LOG_WARN("DNS lookup of {} failed ({}); keeping {} workers", spec, a.error, kept);
      } else {
        KV_LOG_WARN("DNS lookup of {} returned no address; keeping {} workers", spec, kept);
      }
    }
    absl::flat_hash_set<std::string> members;
    for (const auto& [spec, addresses] : dns_last_good_) members.insert(addresses.begin(), addresses.end());
    for (const auto& a : members) {
      AddLocked(a);
      auto it = workers_.find(a);
      if (it != workers_.end() && it->second->departed) {
        it->second->departed = false;
        KV_LOG_INFO("worker {} is back in DNS", a);
      }
    }
    for (auto& [addr, w] : workers_) {
      if (static_.contains(addr) || members.contains(addr) || w->departed) continue;
      w->departed = true;
      KV_LOG_INFO("worker {} left DNS; it takes no new sessions and stays while it drains or holds sessions",
                  addr);
    }
  }
  ReapDeparted();
}

void WorkerPool::ReapDeparted() {
  {
    absl::MutexLock lock(&mu_);
    bool any = false;
    for (const auto& [addr, w] : workers_) any = any || w->departed;
    if (!any) return;
  }
  const absl::flat_hash_map<WorkerId, int64_t> sessions = directory_->SessionCounts();
  std::vector<std::unique_ptr<Worker>> retired;
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = absl::Now();
    for (auto it = workers_.begin(); it != workers_.end();) {
      Worker& w = *it->second;
      auto held = sessions.find(it->first);
      const int64_t n = held == sessions.end() ? 0 : held->second;
      const bool unreachable = !w.connected && now - w.disconnected_since > options_.forget_after;
      // Nothing to hand over: no sessions, and not still draining (a draining
      // worker may yet have sessions the directory has not heard of).
      const bool done = n == 0 && (!w.connected || !w.draining());
      if (!w.departed || !(unreachable || done)) {
        ++it;
        continue;
      }
      KV_LOG_INFO("worker {} left DNS and {}: removing it", it->first,
                  unreachable ? "is unreachable" : "holds no sessions");
      w.stop.Notify();
      if (w.stream != nullptr) w.stream->TryCancel();
      retired.push_back(std::move(it->second));
      workers_.erase(it++);
    }
  }
  Retire(std::move(retired));
}

void WorkerPool::Watch(Worker* w) {
  auto stub = v1::Worker::NewStub(w->channel);
  while (!w->stop.HasBeenNotified()) {
    grpc::ClientContext ctx;
    {
      absl::MutexLock lock(&mu_);
      if (w->stop.HasBeenNotified()) break;
      w->stream = &ctx;
    }
    v1::WatchRequest req;
    req.set_subscriber("kvcache-router");
    auto reader = stub->Watch(&ctx, req);
    v1::WatchEvent ev;
    WatchIngest ingest(directory_, w->address);  // a new stream: sequence 1, a snapshot first
    bool gap = false;
    while (reader->Read(&ev)) {
      absl::StatusOr<WatchIngest::Applied> applied = ingest.Ingest(&ev);
      if (!applied.ok()) {
        KV_LOG_WARN("worker {}: {}", w->address, std::string(applied.status().message()));
        gap = true;
        break;
      }
      if (*applied == WatchIngest::Applied::kSnapshotPart) continue;
      absl::MutexLock lock(&mu_);
      if (!w->connected) KV_LOG_INFO("worker {} connected", w->address);
      w->connected = true;
      w->reached = true;
      w->suspect = false;
      w->forgotten = false;
      w->last_message = absl::Now();
      if (ev.has_snapshot()) {
        w->worker_id = ev.snapshot().worker_id();
        w->model_id = ev.snapshot().model_id();
        const bool wrong = !options_.model_id.empty() && w->model_id != options_.model_id;
        if (wrong && !w->wrong_model) {
          KV_LOG_ERROR("worker {} serves model {}, not this router's {} (--model): it gets no requests",
                       w->address, w->model_id, options_.model_id);
        } else if (!wrong && w->wrong_model) {
          KV_LOG_INFO("worker {} serves this router's model now", w->address);
        }
        w->wrong_model = wrong;
        w->kv_shape = ev.snapshot().kv_shape();
        w->load = ev.snapshot().load();
        if (!w->load.draining()) {
          // A drain never ends in the process that began it: a new stream's
          // snapshot that is not draining comes from a new process at this
          // address (a restart, a rescheduled pod), which takes work again.
          w->admin_draining = false;
          w->refused_draining = false;
        }
        ++w->load_reports;
      } else if (ev.has_load()) {
        w->load = ev.load();
        ++w->load_reports;
      }
    }
    // Cancelled only when this side ends it: a cancel after the stream ended
    // would hide the worker's status (a refusal, say) behind CANCELLED.
    if (gap) ctx.TryCancel();
    grpc::Status st = reader->Finish();
    {
      absl::MutexLock lock(&mu_);
      w->stream = nullptr;
      if (w->connected) {
        KV_LOG_WARN("worker {} watch ended: {}", w->address, st.error_message());
        w->connected = false;
        w->disconnected_since = absl::Now();
        w->refusal.clear();
      } else if ((st.error_code() == grpc::UNAUTHENTICATED || st.error_code() == grpc::PERMISSION_DENIED) &&
                 st.error_message() != w->refusal) {
        // Retried every reconnect_backoff: said once, or the operator sees no
        // reason for a worker that stays DOWN.
        w->refusal = st.error_message();
        KV_LOG_ERROR(
            "worker {} refuses this router ({}: {}); check that both use the same "
            "--cluster_token_file, or TLS certificates of one CA",
            w->address, st.error_code() == grpc::UNAUTHENTICATED ? "UNAUTHENTICATED" : "PERMISSION_DENIED",
            st.error_message());
      }
    }
    w->stop.WaitForNotificationWithTimeout(options_.reconnect_backoff);
  }
}

WorkerView WorkerPool::ViewLocked(const Worker& w) const {
  WorkerView v;
  v.address = w.address;
  v.worker_id = w.worker_id.empty() ? w.address : w.worker_id;
  v.connected = w.connected;
  v.draining = w.draining();
  v.admin_draining = w.admin_draining;
  v.departed = w.departed;
  v.discovered = !static_.contains(w.address);
  v.reached = w.reached;
  v.wrong_model = w.wrong_model;
  v.healthy = w.connected && !w.suspect && !v.draining && !w.wrong_model;
  v.load = w.load;
  v.load_reports = w.load_reports;
  v.model_id = w.model_id;
  v.kv_shape = w.kv_shape;
  return v;
}

std::vector<WorkerView> WorkerPool::Workers() const {
  absl::MutexLock lock(&mu_);
  std::vector<WorkerView> out;
  for (const auto& [addr, w] : workers_) out.push_back(ViewLocked(*w));
  std::sort(out.begin(), out.end(),
            [](const WorkerView& a, const WorkerView& b) { return a.address < b.address; });
  return out;
}

std::vector<WorkerView> WorkerPool::Healthy() const {
  std::vector<WorkerView> out;
  for (WorkerView& v : Workers()) {
    if (v.healthy) out.push_back(std::move(v));
  }
  return out;
}

std::optional<WorkerView> WorkerPool::Find(const std::string& address_or_id) const {
  absl::MutexLock lock(&mu_);
  for (const auto& [addr, w] : workers_) {
    if (addr == address_or_id || w->worker_id == address_or_id) return ViewLocked(*w);
  }
  return std::nullopt;
}

std::shared_ptr<grpc::Channel> WorkerPool::Channel(const WorkerId& address) const {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(address);
  return it == workers_.end() ? nullptr : it->second->channel;
}

void WorkerPool::SetDraining(const WorkerId& address) {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(address);
  if (it != workers_.end()) it->second->admin_draining = true;
}

void WorkerPool::EndAdminDrain(const WorkerId& address) {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(address);
  if (it != workers_.end()) it->second->admin_draining = false;
}

bool WorkerPool::Draining(const WorkerId& address) const {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(address);
  return it != workers_.end() && it->second->draining();
}

void WorkerPool::MarkDraining(const WorkerId& address) {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(address);
  if (it != workers_.end()) it->second->refused_draining = true;
}

void WorkerPool::MarkSuspect(const WorkerId& address) {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(address);
  if (it != workers_.end()) it->second->suspect = true;
}

bool WorkerPool::AwaitHealthy(size_t n, bool want, absl::Duration timeout) const {
  absl::MutexLock lock(&mu_);
  auto enough = [this, n, want]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (stopping_) return true;
    size_t healthy = 0;
    for (const auto& [addr, w] : workers_) healthy += ViewLocked(*w).healthy ? 1 : 0;
    return (healthy >= n) == want;
  };
  return mu_.AwaitWithTimeout(absl::Condition(&enough), timeout) && !stopping_;
}

}  // namespace kvcache::router
