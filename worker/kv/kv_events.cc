#include "worker/kv/kv_events.h"

namespace kvcache::kv {

const char* EventTypeName(KvEventType t) {
  switch (t) {
    case KvEventType::kSessionPlaced:
      return "session_placed";
    case KvEventType::kSessionOffloaded:
      return "session_offloaded";
    case KvEventType::kSessionRestored:
      return "session_restored";
    case KvEventType::kSessionDropped:
      return "session_dropped";
    case KvEventType::kSessionExported:
      return "session_exported";
    case KvEventType::kSessionClosed:
      return "session_closed";
    case KvEventType::kSessionMigrated:
      return "session_migrated";
    case KvEventType::kPrefixStored:
      return "prefix_stored";
    case KvEventType::kPrefixRemoved:
      return "prefix_removed";
  }
  return "unknown";
}

void EventLog::Append(KvEvent event) {
  event.seq = next_seq_++;
  ring_.push_back(std::move(event));
  while (ring_.size() > capacity_) ring_.pop_front();
}

EventBatch EventLog::Read(uint64_t after_seq, size_t max_events) const {
  EventBatch out;
  out.last_seq = last_seq();
  if (ring_.empty()) return out;
  const uint64_t first = ring_.front().seq;
  out.gap = after_seq + 1 < first;
  size_t i = after_seq + 1 <= first ? 0 : static_cast<size_t>(after_seq + 1 - first);
  for (; i < ring_.size() && out.events.size() < max_events; ++i) out.events.push_back(ring_[i]);
  return out;
}

}  // namespace kvcache::kv
