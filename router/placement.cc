#include "router/placement.h"

#include <xxhash.h>

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"

namespace kvcache::router {
namespace {

// Prompt tokens per second assumed when no candidate has reported a rate yet
// (only the ratios between candidates matter then, and they are all equal).
constexpr double kDefaultPrefillRate = 1000.0;

}  // namespace

const char* PlacementReasonName(PlacementReason r) {
  switch (r) {
    case PlacementReason::kAffinity:
      return "affinity";
    case PlacementReason::kPrefix:
      return "prefix";
    case PlacementReason::kLoad:
      return "load";
    case PlacementReason::kRetry:
      return "retry";
  }
  return "unknown";
}

double LoadTokens(const PlacementConfig& c, const Candidate& cand) {
  const v1::WorkerLoad& load = cand.load;
  const int64_t queued = std::max<int64_t>(load.queued_prefill_tokens(), cand.dispatched_prefill_tokens);
  const int64_t requests =
      std::max<int64_t>(load.running_requests() + load.waiting_requests(), cand.dispatched_requests);
  return static_cast<double>(queued) + c.decode_token_weight * static_cast<double>(requests);
}

uint64_t RendezvousWeight(const std::string& key, const WorkerId& worker) {
  // Hash of the pair, with the key as seed material so that (k, w) and (w, k)
  // differ.
  const uint64_t seed = XXH3_64bits(key.data(), key.size());
  return XXH3_64bits_withSeed(worker.data(), worker.size(), seed);
}

absl::StatusOr<Placement> Choose(const PlacementConfig& c, const std::string& session_id,
                                 const WorkerId& affinity_worker, int page_tokens, int request_pages,
                                 const std::vector<Candidate>& candidates, bool retry) {
  if (candidates.empty()) return absl::UnavailableError("no healthy worker can take the request");
  if (!affinity_worker.empty()) {
    for (const Candidate& cand : candidates) {
      if (cand.worker == affinity_worker) {
        return Placement{cand.worker, PlacementReason::kAffinity, page_tokens * cand.match.total_pages(), 0};
      }
    }
  }
  double mean = 0;
  double fastest = 0;
  for (const Candidate& cand : candidates) {
    mean += LoadTokens(c, cand);
    fastest = std::max(fastest, cand.load.prefill_tokens_per_second());
  }
  if (fastest <= 0) fastest = kDefaultPrefillRate;
  mean /= static_cast<double>(candidates.size());
  const double cap = c.cap_factor * (mean + c.cap_slack);
  bool any_under_cap = false;
  for (const Candidate& cand : candidates) any_under_cap |= LoadTokens(c, cand) <= cap;
  const double request_tokens = static_cast<double>(page_tokens) * request_pages;

  const Candidate* best = nullptr;
  double best_score = -std::numeric_limits<double>::infinity();
  uint64_t best_weight = 0;
  for (const Candidate& cand : candidates) {
    const double load = LoadTokens(c, cand);
    if (any_under_cap && load > cap) continue;
    const double reuse =
        page_tokens * (cand.match.device_pages + c.host_restore_weight * cand.match.host_pages);
    const int64_t needed = std::max(0, request_pages - cand.match.device_pages);
    const int64_t shortfall = std::max<int64_t>(0, needed - cand.load.pages_free_device());
    const double pressure =
        cand.load.pages_total_device() > 0 ? c.eviction_weight * page_tokens * shortfall : 0;
    const double rate =
        cand.load.prefill_tokens_per_second() > 0 ? cand.load.prefill_tokens_per_second() : fastest;
    const double score = -(request_tokens - reuse + c.load_weight * load + pressure) / rate;
    const uint64_t weight = RendezvousWeight(session_id, cand.worker);
    const bool tie = best != nullptr && score == best_score;
    if (best == nullptr || score > best_score || (tie && cand.sessions < best->sessions) ||
        (tie && cand.sessions == best->sessions && weight > best_weight)) {
      best = &cand;
      best_score = score;
      best_weight = weight;
    }
  }
  Placement p;
  p.worker = best->worker;
  p.score = best_score;
  p.predicted_cached_tokens = page_tokens * best->match.total_pages();
  if (retry) {
    p.reason = PlacementReason::kRetry;
  } else {
    p.reason = best->match.total_pages() > 0 ? PlacementReason::kPrefix : PlacementReason::kLoad;
  }
  return p;
}

}  // namespace kvcache::router
