// Fans the worker's cache events and load reports out to every Watch stream.
//
// A pump thread reads the KV cache's event log and, every report interval, the
// engine's load, converts them to WatchEvents and hands them to subscribers.
// Each subscriber first gets a snapshot (taken under the same sequence number as
// the events that follow, so none is missed or repeated; in parts when large,
// see WorkerSnapshot.more), then events in order.
// A subscriber that falls too far behind, or any event-log gap, ends the stream
// with UNAVAILABLE: the router reconnects and gets a fresh snapshot.
//
// Thread-safety: all public methods are thread-safe.
#ifndef KVCACHE_WORKER_SERVICE_WATCH_HUB_H_
#define KVCACHE_WORKER_SERVICE_WATCH_HUB_H_

#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "kvcache/v1/worker.grpc.pb.h"
#include "worker/kv/kv_cache_manager.h"
#include "worker/sched/engine.h"

namespace kvcache::service {

struct WatchHubOptions {
  std::string worker_id;
  std::string model_id;
  absl::Duration load_interval = absl::Seconds(1);
  absl::Duration poll_interval = absl::Milliseconds(20);  // event-log polling
  size_t max_queued = 10000;                              // per subscriber, before it is cut off
  size_t snapshot_part_entries = 4096;                    // sessions + block hashes per snapshot message
};

class WatchHub {
 public:
  WatchHub(WatchHubOptions options, kv::KvCacheManager* kv, sched::Engine* engine,
           std::function<bool()> draining);
  ~WatchHub();  // Stop()

  // A Watch stream's server-side reactor. Deletes itself when the RPC ends.
  grpc::ServerWriteReactor<v1::WatchEvent>* Subscribe(grpc::CallbackServerContext* context);

  // The load report as sent on Watch (also used by the drain logic and tests).
  v1::WorkerLoad CurrentLoad() const;
  // Open Watch streams (routers listening).
  size_t subscribers() const;
  // Ends every stream (OK) and the pump.
  void Stop();
  // Wakes the pump now (after a change the routers should hear about quickly).
  void Nudge();
  // Hands every cache event so far to the subscribers' streams now, on the
  // caller's thread: a reply sent after Flush trails the events that describe
  // it, so a router sees where a session lives before its client can ask again.
  void Flush();

 private:
  class Subscriber;
  void Pump();
  void DeliverEventsLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The snapshot in parts (WorkerSnapshot.more), each under the gRPC message limit.
  std::vector<v1::WorkerSnapshot> MakeSnapshot(uint64_t* last_seq) const;
  void Remove(Subscriber* s);

  const WatchHubOptions options_;
  kv::KvCacheManager* const kv_;
  sched::Engine* const engine_;
  const std::function<bool()> draining_;

  mutable absl::Mutex mu_;
  absl::CondVar wake_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool nudged_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t last_seq_ ABSL_GUARDED_BY(mu_) = 0;  // newest KV event handed out
  absl::flat_hash_map<Subscriber*, bool> subscribers_ ABSL_GUARDED_BY(mu_);
  std::thread pump_;
};

// Converts a KV cache event into its wire form; false for events routers ignore.
bool ToCacheEvent(const kv::KvEvent& in, v1::CacheEvent* out);

}  // namespace kvcache::service

#endif  // KVCACHE_WORKER_SERVICE_WATCH_HUB_H_
