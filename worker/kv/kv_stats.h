// Counters of the KV cache, a consistent copy taken under the manager's lock.
//
// Thread-safety: plain values.
#ifndef KVCACHE_WORKER_KV_KV_STATS_H_
#define KVCACHE_WORKER_KV_KV_STATS_H_

#include <cstdint>

namespace kvcache::kv {

// Pages of one tier by state. Every page is in exactly one state:
//   capacity_pages = free + session_private + prefix_shared + cached_unreferenced + in_flight
struct TierStats {
  int64_t capacity_pages = 0;             // budget_bytes / page_bytes
  int64_t free_pages = 0;                 // on the free list
  int64_t session_private_pages = 0;      // ref >= 1 and not in the prefix cache (tier 1: all used)
  int64_t prefix_shared_pages = 0;        // ref >= 1 and in the prefix cache (tier 0 only)
  int64_t cached_unreferenced_pages = 0;  // ref == 0, in the prefix cache: evictable, LRU
  int64_t in_flight_pages = 0;            // staging pages of imports not yet committed
  // Tier 0: pages of sessions running, pinned, in a step, exporting or
  // restoring, each once: the pressure policy frees none of them short of
  // preempting. The rest of the tier (free, cached, idle sessions' pages,
  // which it offloads or drops), less in_flight_pages, is what a request or a
  // session moving in can have.
  int64_t held_pages = 0;
};

struct KvStats {
  TierStats tier[2];
  int64_t sessions = 0;
  int64_t offloaded_sessions = 0;  // sessions with at least one page in tier 1

  // Prefix cache, in tokens. hit_rate = prefix_hit_tokens / prefix_query_tokens.
  int64_t prefix_query_tokens = 0;   // sum of prompt lengths passed to AttachPrefix
  int64_t prefix_hit_tokens = 0;     // sum of tokens attached from cached pages
  int64_t prefix_pages_stored = 0;   // pages registered in the prefix cache
  int64_t prefix_pages_evicted = 0;  // cached-unreferenced pages evicted (policy step 2)

  // Tier movement. *_bytes = *_pages * page_bytes.
  int64_t offloads = 0;  // sessions offloaded (explicit or policy step 3)
  int64_t offload_pages = 0;
  int64_t offload_bytes = 0;
  int64_t restores = 0;
  int64_t restore_pages = 0;
  int64_t restore_bytes = 0;
  int64_t drops = 0;              // sessions that lost pages (policy step 4, checksum failure)
  int64_t dropped_pages = 0;      // page-table entries cut by drops
  int64_t preemptions = 0;        // running sessions offloaded by policy step 5
  int64_t checksum_failures = 0;  // pages rejected on restore or import

  // Waste, in token slots, summed over sessions (a shared page counts once per session):
  //   allocated_token_slots = sum(live pages of session) * page_tokens
  //   used_token_slots      = sum(committed tokens held in live pages)
  //   waste_token_slots     = allocated_token_slots - used_token_slots
  int64_t allocated_token_slots = 0;
  int64_t used_token_slots = 0;
  int64_t waste_token_slots = 0;
};

}  // namespace kvcache::kv

#endif  // KVCACHE_WORKER_KV_KV_STATS_H_
