#include "worker/service/watch_hub.h"

#include <algorithm>
#include <atomic>
#include <string>

#include "common/logging.h"
#include "common/stream_writer.h"
#include "worker/kv/session_key.h"

namespace kvcache::service {

bool ToCacheEvent(const kv::KvEvent& in, v1::CacheEvent* out) {
  out->Clear();
  // KV events name sessions by their (tenant, id) key; the wire carries the pair.
  if (!in.session_id.empty()) out->set_session_id(kv::SplitSessionKey(in.session_id).id);
  out->set_tenant(in.tenant);
  out->set_tokens(static_cast<int32_t>(in.num_tokens));
  out->set_tier(v1::TIER_DEVICE);
  switch (in.type) {
    case kv::KvEventType::kSessionPlaced:
      out->set_kind(v1::CacheEvent::SESSION_PLACED);
      break;
    case kv::KvEventType::kSessionOffloaded:
      out->set_kind(v1::CacheEvent::SESSION_OFFLOADED);
      out->set_tier(v1::TIER_HOST);
      break;
    case kv::KvEventType::kSessionRestored:
      out->set_kind(v1::CacheEvent::SESSION_RESTORED);
      break;
    case kv::KvEventType::kSessionDropped:
      out->set_kind(v1::CacheEvent::SESSION_TRUNCATED);
      break;
    case kv::KvEventType::kSessionClosed:
      out->set_kind(v1::CacheEvent::SESSION_DROPPED);
      break;
    case kv::KvEventType::kSessionMigrated:
      out->set_kind(v1::CacheEvent::SESSION_EXPORTED);
      out->set_target_worker(in.target);
      break;
    case kv::KvEventType::kPrefixStored:
    case kv::KvEventType::kPrefixRemoved:
      out->set_kind(in.type == kv::KvEventType::kPrefixStored ? v1::CacheEvent::PREFIX_STORED
                                                              : v1::CacheEvent::PREFIX_REMOVED);
      out->set_tier(in.tier == 1 ? v1::TIER_HOST : v1::TIER_DEVICE);
      for (const BlockHash& h : in.hashes) {
        out->add_block_hashes(std::string(h.bytes.begin(), h.bytes.end()));
      }
      break;
    case kv::KvEventType::kSessionExported:  // a copy was taken; the session stays
      return false;
  }
  return true;
}

class WatchHub::Subscriber : public StreamWriter<v1::WatchEvent> {
 public:
  Subscriber(WatchHub* hub, uint64_t skip_until, size_t max_queued)
      : StreamWriter(max_queued), hub_(hub), skip_until_(skip_until) {}

  // Queues one message, stamped with this stream's next sequence number. The
  // hub calls it only under its own mutex, which keeps numbers and queue order
  // in step.
  void Send(v1::WatchEvent event) {
    event.set_sequence(sequence_.fetch_add(1) + 1);
    Push(std::move(event));
  }
  uint64_t skip_until() const { return skip_until_; }

 private:
  void OnClientGone() override { Close(grpc::Status(grpc::StatusCode::CANCELLED, "watch cancelled")); }
  void OnFinished() override { hub_->Remove(this); }

  WatchHub* const hub_;
  const uint64_t skip_until_;
  std::atomic<uint64_t> sequence_{0};
};

WatchHub::WatchHub(WatchHubOptions options, kv::KvCacheManager* kv, sched::Engine* engine,
                   std::function<bool()> draining)
    : options_(std::move(options)), kv_(kv), engine_(engine), draining_(std::move(draining)) {
  last_seq_ = kv_->ReadEvents(0, 0).last_seq;
  pump_ = std::thread([this] { Pump(); });
}

WatchHub::~WatchHub() { Stop(); }

void WatchHub::Stop() {
  {
    absl::MutexLock lock(&mu_);
    if (!stopping_) {
      stopping_ = true;
      wake_.Signal();
      for (auto& [s, unused] : subscribers_) s->Close(grpc::Status::OK);
    }
  }
  if (pump_.joinable()) pump_.join();
}

size_t WatchHub::subscribers() const {
  absl::MutexLock lock(&mu_);
  return subscribers_.size();
}

void WatchHub::Nudge() {
  absl::MutexLock lock(&mu_);
  nudged_ = true;
  wake_.Signal();
}

void WatchHub::Remove(Subscriber* s) {
  absl::MutexLock lock(&mu_);
  subscribers_.erase(s);
}

v1::WorkerLoad WatchHub::CurrentLoad() const {
  const kv::KvStats st = kv_->GetStats();
  const sched::EngineLoad el = engine_->Load();
  v1::WorkerLoad load;
  load.set_pages_total_device(st.tier[0].capacity_pages);
  load.set_pages_free_device(st.tier[0].free_pages + st.tier[0].cached_unreferenced_pages);
  load.set_pages_held_device(st.tier[0].held_pages + st.tier[0].in_flight_pages);
  load.set_pages_total_host(st.tier[1].capacity_pages);
  load.set_pages_free_host(st.tier[1].free_pages);
  load.set_running_requests(el.running);
  load.set_waiting_requests(el.waiting);
  load.set_queued_prefill_tokens(el.queued_prefill_tokens);
  load.set_decode_tokens_per_second(el.decode_tokens_per_second);
  load.set_prefill_tokens_per_second(el.prefill_tokens_per_second);
  load.set_sessions(static_cast<int32_t>(st.sessions));
  load.set_draining(draining_());
  return load;
}

std::vector<v1::WorkerSnapshot> WatchHub::MakeSnapshot(uint64_t* last_seq) const {
  const kv::KvSnapshot snap = kv_->Snapshot();
  *last_seq = snap.last_seq;
  const size_t per_part = std::max<size_t>(1, options_.snapshot_part_entries);
  std::vector<v1::WorkerSnapshot> parts(1);
  size_t in_part = 0;
  auto room = [&]() -> v1::WorkerSnapshot& {
    if (in_part == per_part) {
      parts.back().set_more(true);
      parts.emplace_back();
      in_part = 0;
    }
    ++in_part;
    return parts.back();
  };
  v1::WorkerSnapshot& head = parts.front();
  head.set_worker_id(options_.worker_id);
  head.set_model_id(options_.model_id);
  const kv::KvShape& shape = kv_->shape();
  v1::KvShape* ks = head.mutable_kv_shape();
  ks->set_layers(shape.layers);
  ks->set_kv_heads(shape.kv_heads);
  ks->set_head_dim(shape.head_dim);
  ks->set_dtype(kv::DtypeName(shape.dtype));
  ks->set_page_tokens(shape.page_tokens);
  ks->set_sliding_window(shape.sliding_window);
  *head.mutable_load() = CurrentLoad();
  for (const kv::SessionInfo& s : snap.sessions) {
    if (kv::IsEphemeralKey(s.id)) continue;  // ephemeral sessions are not routable
    v1::SessionInfo* si = room().add_sessions();
    si->set_session_id(kv::SplitSessionKey(s.id).id);
    si->set_tenant(s.tenant);
    si->set_worker_id(options_.worker_id);
    si->set_tokens_cached(static_cast<int32_t>(s.num_tokens));
    si->set_pages_device(static_cast<int32_t>(s.tier0_pages));
    si->set_pages_host(static_cast<int32_t>(s.tier1_pages));
    si->set_pinned(s.user_pinned);
    si->set_state(s.running ? v1::SESSION_RUNNING
                            : (s.tier1_pages > 0 ? v1::SESSION_OFFLOADED : v1::SESSION_IDLE));
  }
  for (const BlockHash& h : snap.prefix_hashes) {
    room().add_device_block_hashes(std::string(h.bytes.begin(), h.bytes.end()));
  }
  for (const BlockHash& h : snap.host_prefix_hashes) {
    room().add_host_block_hashes(std::string(h.bytes.begin(), h.bytes.end()));
  }
  return parts;
}

grpc::ServerWriteReactor<v1::WatchEvent>* WatchHub::Subscribe(grpc::CallbackServerContext* /*context*/) {
  absl::MutexLock lock(&mu_);
  uint64_t snap_seq = 0;
  std::vector<v1::WorkerSnapshot> parts = MakeSnapshot(&snap_seq);
  // Room for the whole snapshot on top of the usual backlog.
  auto* s = new Subscriber(this, snap_seq, options_.max_queued + parts.size());
  if (stopping_) {
    s->Close(grpc::Status(grpc::StatusCode::UNAVAILABLE, "worker is shutting down"));
    return s;
  }
  subscribers_[s] = true;
  for (v1::WorkerSnapshot& part : parts) {
    v1::WatchEvent ev;
    *ev.mutable_snapshot() = std::move(part);
    s->Send(std::move(ev));
  }
  return s;
}

void WatchHub::Flush() {
  absl::MutexLock lock(&mu_);
  if (!stopping_) DeliverEventsLocked();
}

void WatchHub::DeliverEventsLocked() {
  // Events since the last pass, to every subscriber that has not seen them.
  while (true) {
    kv::EventBatch batch = kv_->ReadEvents(last_seq_, 1024);
    if (batch.gap) {
      KV_LOG_WARN("watch: {} cache events were lost; subscribers must resync", batch.last_seq - last_seq_);
      for (auto& [s, unused] : subscribers_) {
        s->Close(grpc::Status(grpc::StatusCode::UNAVAILABLE, "events lost; reconnect to resync"));
      }
      last_seq_ = batch.last_seq;
      break;
    }
    for (const kv::KvEvent& e : batch.events) {
      v1::WatchEvent w;
      if (!ToCacheEvent(e, w.mutable_event())) continue;
      if (kv::IsEphemeralKey(e.session_id)) continue;  // ephemeral sessions
      for (auto& [s, unused] : subscribers_) {
        if (e.seq > s->skip_until()) s->Send(w);
      }
    }
    if (!batch.events.empty()) last_seq_ = batch.events.back().seq;
    if (batch.events.size() < 1024) break;
  }
}

void WatchHub::Pump() {
  absl::Time next_load = absl::Now() + options_.load_interval;
  while (true) {
    absl::MutexLock lock(&mu_);
    wake_.WaitWithTimeout(&mu_, options_.poll_interval);
    if (stopping_) return;
    nudged_ = false;
    DeliverEventsLocked();
    if (absl::Now() >= next_load) {
      next_load = absl::Now() + options_.load_interval;
      v1::WatchEvent w;
      *w.mutable_load() = CurrentLoad();
      for (auto& [s, unused] : subscribers_) s->Send(w);
    }
  }
}

}  // namespace kvcache::service
