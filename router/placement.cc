#include "router/placement.h"

#include <xxhash.h>

#include <algorithm>
#include <cmath>
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
                                 bool new_session, const std::vector<Candidate>& candidates, bool retry) {
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
  int64_t sessions = 0;
  for (const Candidate& cand : candidates) {
    mean += LoadTokens(c, cand);
    fastest = std::max(fastest, cand.load.prefill_tokens_per_second());
    sessions += cand.sessions;
  }
  if (fastest <= 0) fastest = kDefaultPrefillRate;
  mean /= static_cast<double>(candidates.size());
  const double cap = c.cap_factor * (mean + c.cap_slack);
  auto rate_of = [fastest](const Candidate& cand) {
    return cand.load.prefill_tokens_per_second() > 0 ? cand.load.prefill_tokens_per_second() : fastest;
  };
  // Each worker's share of the sessions is its share of the pages that keep
  // them (both tiers): a worker with twice the memory keeps twice the
  // conversations. Equal shares while any worker has not reported its pages.
  auto pages_of = [](const Candidate& cand) {
    return static_cast<double>(cand.load.pages_total_device() + cand.load.pages_total_host());
  };
  double total_pages = 0;
  bool pages_known = true;
  for (const Candidate& cand : candidates) {
    total_pages += pages_of(cand);
    pages_known &= pages_of(cand) > 0;
  }
  auto share = [&](const Candidate& cand) {
    return pages_known ? pages_of(cand) / total_pages : 1.0 / static_cast<double>(candidates.size());
  };
  const bool cap_sessions = new_session && c.session_cap_factor > 0;
  // 3: under both caps, 2: under the load cap only, 1: under the session cap
  // only, 0: neither; plus 4 where tier 0 holds the request whole. The best
  // level any candidate reaches is the one to choose from.
  auto level = [&](const Candidate& cand) {
    const bool load_ok = c.cap_factor <= 0 || LoadTokens(c, cand) <= cap;
    const double session_cap =
        std::ceil(c.session_cap_factor * static_cast<double>(sessions + 1) * share(cand));
    const bool sessions_ok = !cap_sessions || static_cast<double>(cand.sessions + 1) <= session_cap;
    return (cand.holds_context ? 4 : 0) + (load_ok ? 2 : 0) + (sessions_ok ? 1 : 0);
  };
  std::vector<int> levels;
  levels.reserve(candidates.size());
  int eligible = 0;
  for (const Candidate& cand : candidates) {
    levels.push_back(level(cand));
    eligible = std::max(eligible, levels.back());
  }
  const double request_tokens = static_cast<double>(page_tokens) * request_pages;

  const Candidate* best = nullptr;
  double best_score = -std::numeric_limits<double>::infinity();
  uint64_t best_weight = 0;
  for (size_t i = 0; i < candidates.size(); ++i) {
    const Candidate& cand = candidates[i];
    if (levels[i] < eligible) continue;
    const double load = LoadTokens(c, cand);
    const double reuse =
        page_tokens * (cand.match.device_pages + c.host_restore_weight * cand.match.host_pages);
    const int64_t needed = std::max(0, request_pages - cand.match.device_pages);
    const int64_t shortfall = std::max<int64_t>(0, needed - cand.load.pages_free_device());
    const double pressure =
        cand.load.pages_total_device() > 0 ? c.eviction_weight * page_tokens * shortfall : 0;
    const double rate = rate_of(cand);
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
