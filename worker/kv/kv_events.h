// The KV cache's change stream, for routers (prefix-affinity) and observability.
//
// Every change appends one KvEvent with a sequence number that increases by one per
// event. Consumers pull with Read(after_seq): a bounded ring keeps the newest
// `capacity` events; a consumer that fell behind sees `gap == true` and resyncs from
// KvCacheManager::Snapshot(), whose `last_seq` says which events it already reflects.
//
// Thread-safety: EventLog is not synchronised; KvCacheManager guards it.
#ifndef KVCACHE_WORKER_KV_KV_EVENTS_H_
#define KVCACHE_WORKER_KV_KV_EVENTS_H_

#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "common/block_hash.h"

namespace kvcache::kv {

enum class KvEventType : uint8_t {
  kSessionPlaced,     // created, forked or imported; tier 0
  kSessionOffloaded,  // pages moved to tier 1 (`pages` = pages moved)
  kSessionRestored,   // pages moved back to tier 0
  kSessionDropped,    // cache lost (tier-1 drop, checksum failure); `num_tokens` = what is left
  kSessionExported,   // a full export finished (the session stays here)
  kSessionClosed,
  kSessionMigrated,  // closed here because `target` holds it now (a finished migration)
  kPrefixStored,     // `hashes` became available in the prefix cache, in `tier`
  kPrefixRemoved,    // `hashes` left the prefix cache of `tier`
};
const char* EventTypeName(KvEventType t);

struct KvEvent {
  uint64_t seq = 0;
  KvEventType type = KvEventType::kSessionPlaced;
  std::string session_id;  // empty for prefix events
  std::string tenant;
  int64_t num_tokens = 0;         // session events: the session's token count after the change
  int64_t pages = 0;              // pages involved
  std::vector<BlockHash> hashes;  // prefix events
  int8_t tier = 0;                // prefix events: 0 (backend memory) or 1 (host RAM)
  std::string target;             // kSessionMigrated: the worker that holds the session now
};

struct EventBatch {
  std::vector<KvEvent> events;  // seq > after_seq, ascending
  bool gap = false;             // events after `after_seq` were lost: resync via Snapshot()
  uint64_t last_seq = 0;        // newest sequence number assigned so far
};

class EventLog {
 public:
  // REQUIRES: capacity >= 1.
  explicit EventLog(size_t capacity) : capacity_(capacity) {}
  // Assigns the next sequence number and stores the event.
  void Append(KvEvent event);
  // At most `max_events` events with seq > after_seq.
  EventBatch Read(uint64_t after_seq, size_t max_events) const;
  uint64_t last_seq() const { return next_seq_ - 1; }

 private:
  size_t capacity_;
  std::deque<KvEvent> ring_;
  uint64_t next_seq_ = 1;
};

}  // namespace kvcache::kv

#endif  // KVCACHE_WORKER_KV_KV_EVENTS_H_
