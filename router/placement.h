// Placement: which worker serves a request.
//
// In order:
//  1. affinity: the worker that holds the session, if it is a candidate
//     (healthy, not draining, not excluded);
//  2. otherwise the candidate with the earliest estimated time to first token,
//     one unit for reuse and queueing alike:
//        ttft = (request_tokens - reuse + load_weight * queued + eviction) / prefill_rate
//        reuse    = page_tokens * (device_pages + host_restore_weight * host_pages)
//        queued   = max(reported queued_prefill_tokens, dispatched_prefill_tokens)
//                 + decode_token_weight * max(reported running + waiting, dispatched_requests)
//        eviction = eviction_weight * page_tokens * max(0, pages_needed - pages_free_device)
//     (dispatched_*: what this router sent the worker and has not seen finish,
//     counted at once, so a burst does not herd onto one worker between load
//     reports; prefill_rate: the worker's reported prompt tokens per second, or
//     the fastest reported rate for a worker that has not prefilled yet;
//     pages_needed: the request's pages not already cached there, placing it
//     where tier 0 is full evicts other sessions' pages to host RAM), among
//     candidates under the bounded-load cap: a worker whose queued tokens exceed
//     cap_factor * (mean + cap_slack) is skipped unless every worker is over it
//     (so one hot prefix cannot herd all traffic onto one worker). A new named
//     session stays where it is placed, with every later turn, so for one the
//     sessions are bounded too: a worker that would hold more than
//     ceil(session_cap_factor * (sessions + 1) * its share of the candidates'
//     KV pages) is skipped unless every worker would (consistent hashing with
//     bounded loads, Mirrokni, Thorup and Zadimoghaddam 2018, weighted by
//     memory); since the score sees only this request's time to first token, a
//     system prompt cached on one worker would otherwise draw every new
//     conversation there while the others idle. Before both, a worker whose
//     whole tier 0 cannot hold the request's context and the reply it asked
//     for (Candidate::holds_context) would cut that reply short, so it comes
//     after every worker that can. Candidates under both caps
//     come first, then those under the load cap only, then those under the
//     session cap only, then all;
//  3. ties go to the worker holding fewer sessions (so new sessions without a
//     cached prefix spread over idle workers), then by rendezvous hashing of (session
//     id, worker id), so every router replica picks the same worker for the
//     same inputs.
// The decision carries its reason (for the decisions-by-reason metric) and the
// tokens it expects the worker to reuse (compared later with what it reports).
//
// Thread-safety: Choose is a pure function of its arguments.
#ifndef KVCACHE_ROUTER_PLACEMENT_H_
#define KVCACHE_ROUTER_PLACEMENT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "router/directory.h"

namespace kvcache::router {

struct PlacementConfig {
  // A Tier-1 page is worth this fraction of a Tier-0 page (it costs a restore).
  double host_restore_weight = 0.8;
  // Cost of one queued prefill token, in reused-token units.
  double load_weight = 1.0;
  // A running decode stream counts as this many queued tokens.
  double decode_token_weight = 32.0;
  // Cost of each page the request would push out of a full tier 0, in tokens
  // per page token (an evicted page is restored, or recomputed, later).
  double eviction_weight = 1.0;
  // Bounded-load cap (0 disables, else >= 1): load <= cap_factor * (mean + cap_slack).
  double cap_factor = 1.5;
  double cap_slack = 256.0;
  // Bounded sessions for a new session (0 disables, else >= 1): sessions after
  // placing <= ceil(session_cap_factor * (all sessions + 1) * pages / all pages),
  // pages: pages_total_device + pages_total_host.
  double session_cap_factor = 1.0;
};

struct Candidate {
  WorkerId worker;
  v1::WorkerLoad load;
  PrefixMatch match;                // leading pages of the request's chain held there
  int64_t sessions = 0;             // sessions there (the directory's, and those being created)
  int64_t dispatched_requests = 0;  // WorkerView's
  int64_t dispatched_prefill_tokens = 0;
  // Its whole tier 0 holds the request's context and the reply it asked for
  // (true while it has not reported its pages): a worker that cannot would
  // cut the reply short (CONTEXT_FULL), so it is chosen only if none can.
  bool holds_context = true;
};

enum class PlacementReason { kAffinity, kPrefix, kLoad, kRetry };
const char* PlacementReasonName(PlacementReason r);

struct Placement {
  WorkerId worker;
  PlacementReason reason = PlacementReason::kLoad;
  int32_t predicted_cached_tokens = 0;
  double score = 0;  // minus the estimated time to first token, seconds
};

// REQUIRES: candidates hold only workers allowed for this request (healthy, not
// draining, not already tried). `affinity_worker` may be empty. `request_pages`
// is the pages the request's context needs (0 when unknown). `new_session`: the
// request keeps a session where it is placed (the session cap applies).
// UNAVAILABLE when there is no candidate.
absl::StatusOr<Placement> Choose(const PlacementConfig& config, const std::string& session_id,
                                 const WorkerId& affinity_worker, int page_tokens, int request_pages,
                                 bool new_session, const std::vector<Candidate>& candidates, bool retry);

// Load of a worker in queued-token units (`queued` above: what the cap and the
// estimate use).
double LoadTokens(const PlacementConfig& config, const Candidate& candidate);

// Rendezvous (highest random weight) hash of a (key, worker) pair.
uint64_t RendezvousWeight(const std::string& key, const WorkerId& worker);

}  // namespace kvcache::router

#endif  // KVCACHE_ROUTER_PLACEMENT_H_
