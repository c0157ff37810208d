// KvCacheManager: the tenant-scoped prefix index (chained block hashes of full
// pages -> tier-0 pages): publishing full pages, attaching and looking up prefixes.
#include <algorithm>
#include <cassert>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/kv/kv_cache_manager.h"
#include "worker/kv/session_key.h"

namespace kvcache::kv {

void KvCacheManager::PublishFullPages(Session& s) {
  const int64_t full = static_cast<int64_t>(s.tokens.size()) / P();
  std::vector<BlockHash> stored;
  for (int64_t i = static_cast<int64_t>(s.hashes.size()); i < full; ++i) {
    const BlockHash parent = i == 0 ? BlockHash::Zero() : s.hashes[i - 1];
    const BlockHash h = ComputeBlockHash(parent, options_.model_id, s.tenant,
                                         absl::MakeConstSpan(s.tokens).subspan(i * P(), P()));
    s.hashes.push_back(h);
    const PageLoc loc = s.pages[i];
    if (loc.tier != 0 || pool_[0].cached(loc.id) || prefix_index_.contains(h)) continue;
    prefix_index_.emplace(h, loc.id);
    page_hash_[loc.id] = h;
    pool_[0].SetCached(loc.id, true);
    stored.push_back(h);
  }
  if (!stored.empty()) {
    // The count first: the order in which arguments are evaluated is unspecified,
    // and GCC moves `stored` out before reading its size.
    const int64_t n = static_cast<int64_t>(stored.size());
    counters_.prefix_pages_stored += n;
    Emit(KvEventType::kPrefixStored, nullptr, n, std::move(stored));
  }
}

absl::StatusOr<int64_t> KvCacheManager::AttachPrefix(const std::string& id,
                                                     absl::Span<const int32_t> prompt) {
  absl::MutexLock l(&mu_);
  KVCACHE_ASSIGN_OR_RETURN(Session * s, Find(id));
  if (!s->tokens.empty() || s->in_step || s->export_frozen) {
    return absl::FailedPreconditionError(QuoteSession(id) + ": AttachPrefix needs an empty session");
  }
  if (static_cast<int64_t>(prompt.size()) > options_.max_session_tokens) {
    return absl::InvalidArgumentError(QuoteSession(id) + ": prompt longer than max_session_tokens");
  }
  counters_.prefix_query_tokens += static_cast<int64_t>(prompt.size());
  BlockHash parent = BlockHash::Zero();
  const uint64_t epoch = ++write_epoch_;
  for (size_t i = 0; (i + 1) * P() <= prompt.size(); ++i) {
    const auto page_tokens = prompt.subspan(i * P(), P());
    const BlockHash h = ComputeBlockHash(parent, options_.model_id, s->tenant, page_tokens);
    auto it = prefix_index_.find(h);
    if (it == prefix_index_.end()) break;
    pool_[0].IncRef(it->second);
    s->pages.push_back(PageLoc{0, it->second});
    s->page_epoch.push_back(epoch);
    s->hashes.push_back(h);
    s->tokens.insert(s->tokens.end(), page_tokens.begin(), page_tokens.end());
    parent = h;
  }
  const int64_t hit = static_cast<int64_t>(s->tokens.size());
  counters_.prefix_hit_tokens += hit;
  ApplyWindow(*s);
  Touch(*s);
  return hit;
}

int64_t KvCacheManager::LookupPrefix(const std::string& tenant, absl::Span<const int32_t> tokens) const {
  absl::MutexLock l(&mu_);
  BlockHash parent = BlockHash::Zero();
  int64_t hit = 0;
  for (size_t i = 0; (i + 1) * P() <= tokens.size(); ++i) {
    parent = ComputeBlockHash(parent, options_.model_id, tenant, tokens.subspan(i * P(), P()));
    if (!prefix_index_.contains(parent)) break;
    hit += P();
  }
  return hit;
}

}  // namespace kvcache::kv
