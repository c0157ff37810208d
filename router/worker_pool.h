// The router's view of its workers: where they are (a static list or DNS names
// re-resolved periodically), whether they are healthy, and a Watch stream per
// worker that feeds the Directory.
//
// A worker is healthy while its Watch stream is connected and has delivered a
// message within `health_timeout`, and it is not draining. A stream that breaks,
// stalls or skips a sequence number is cancelled and reopened; the reconnect
// starts with a snapshot, which replaces what the directory knew of the worker.
// A worker that stays unreachable longer than `forget_after` is removed from the
// directory (its sessions are lost; the next FULL_CONTEXT request recomputes);
// if it comes back with them, a copy that a turn recreated elsewhere meanwhile
// is stale (Directory::RemoveWorker, may_return) and is closed, not used.
//
// Thread-safety: all public methods are thread-safe.
#ifndef KVCACHE_ROUTER_WORKER_POOL_H_
#define KVCACHE_ROUTER_WORKER_POOL_H_

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/peer_auth.h"
#include "grpcpp/grpcpp.h"
#include "kvcache/v1/worker.grpc.pb.h"
#include "router/directory.h"
#include "router/dns_resolver.h"

namespace kvcache::router {

struct WorkerPoolOptions {
  absl::Duration health_timeout = absl::Seconds(3);  // no Watch message for this long: unhealthy
  absl::Duration forget_after = absl::Seconds(30);   // unreachable this long: forgotten
  absl::Duration reconnect_backoff = absl::Milliseconds(200);
  absl::Duration dns_refresh = absl::Seconds(10);
  std::shared_ptr<grpc::ChannelCredentials> credentials;  // insecure when null
  ClusterToken cluster_token;                             // sent on every call to a worker (none when empty)
  grpc::ChannelArguments channel_args;                    // of every channel to a worker (keepalive)
  // Told the result ("ok", "empty", "failed") of every DNS lookup.
  std::function<void(const char* result)> on_dns_result;
  // The model this router tokenises with (gguf::ModelId of its --model file).
  // A worker that reports another takes no requests (a rollout to a new model
  // half done, a wrong image): its replies would not be this model's, and its
  // pages never match this router's prefix hashes. Empty: no check.
  std::string model_id;
};

// What placement and admin calls see of one worker.
struct WorkerView {
  WorkerId address;       // host:port: the key everywhere in the router
  std::string worker_id;  // the worker's own name (from its snapshot)
  bool connected = false;
  bool healthy = false;
  bool draining = false;        // takes no new work (it announced a drain, or an admin started one)
  bool admin_draining = false;  // the drain came through this router's admin API
  bool departed = false;        // left the DNS answer; kept while it drains or holds sessions
  bool discovered = false;      // found by DNS (else a static --workers entry)
  bool reached = false;         // its Watch has been live at least once
  bool wrong_model = false;     // reports another model than WorkerPoolOptions::model_id
  v1::WorkerLoad load;
  // Load reports received from it so far: one taken after a given moment is a
  // later count (see RouterService::Rebalance).
  int64_t load_reports = 0;
  std::string model_id;
  v1::KvShape kv_shape;
};

class WorkerPool {
 public:
  WorkerPool(WorkerPoolOptions options, Directory* directory);
  ~WorkerPool();  // Stop()

  // Static membership: adds watchers for new addresses, removes the others.
  void SetAddresses(const std::vector<std::string>& addresses);
  // DNS membership: `name:port` is resolved now and every dns_refresh; every
  // address it resolves to is a worker (a Kubernetes headless Service).
  // `name` is name:port (system resolver) or dns://HOST:PORT/name:port.
  //
  // Membership follows the answers, with two exceptions that keep sessions: a
  // lookup that fails or comes back empty keeps the name's last good answer;
  // a worker that leaves the answer (a terminating pod) stays, taking no new
  // sessions, while it drains or holds sessions in the directory, until it has
  // handed them over or has been unreachable for forget_after.
  absl::Status AddDnsName(const std::string& name);

  std::vector<WorkerView> Workers() const;
  std::vector<WorkerView> Healthy() const;
  std::optional<WorkerView> Find(const std::string& address_or_id) const;
  std::shared_ptr<grpc::Channel> Channel(const WorkerId& address) const;
  // Stops placing on a worker (admin drain); cleared when it leaves the pool.
  void SetDraining(const WorkerId& address);
  // The worker's Drain call ended: the sessions it could not move (no target
  // had room then) are the routers' to move, as after a SIGTERM (it still
  // drains: its Watch says so, which keeps placement off it).
  void EndAdminDrain(const WorkerId& address);
  // A request saw the worker fail: treat it as unhealthy until its stream
  // delivers again.
  void MarkSuspect(const WorkerId& address);
  // True when the worker at `address` drains (announced, admin-started, or seen
  // in a refusal). One hash lookup: placement asks it for every APPEND.
  bool Draining(const WorkerId& address) const;
  // The worker answered that it drains (kWorkerDrainingMessage): take it as
  // draining now, before its Watch stream says so.
  void MarkDraining(const WorkerId& address);
  // Blocks until "at least `n` workers are healthy" equals `want`, `timeout`
  // passes, or Stop begins; returns whether it does (false once stopping).
  bool AwaitHealthy(size_t n, bool want, absl::Duration timeout) const;

  void Stop();

 private:
  struct Worker;
  void Watch(Worker* w);
  void Resolve();
  // Retires departed workers with nothing left to hand over (see AddDnsName).
  void ReapDeparted();
  void AddLocked(const std::string& address) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Joins the Watch threads of workers that left the membership (already told
  // to stop), then removes them from the directory, so that a retired worker
  // holds no thread and leaves nothing behind.
  void Retire(std::vector<std::unique_ptr<Worker>> retired) ABSL_LOCKS_EXCLUDED(mu_);
  WorkerView ViewLocked(const Worker& w) const ABSL_SHARED_LOCKS_REQUIRED(mu_);

  const WorkerPoolOptions options_;
  Directory* const directory_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<WorkerId, std::unique_ptr<Worker>> workers_ ABSL_GUARDED_BY(mu_);
  std::vector<DnsTarget> dns_targets_ ABSL_GUARDED_BY(mu_);
  // Each name's last answer that held addresses, by DnsTarget::spec.
  absl::flat_hash_map<std::string, std::vector<std::string>> dns_last_good_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<WorkerId, bool> static_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  absl::Notification stop_;
  std::thread resolver_;
  std::thread health_;
};

}  // namespace kvcache::router

#endif  // KVCACHE_ROUTER_WORKER_POOL_H_
