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

void KvCacheManager::IndexDevicePageLocked(PageId page, const BlockHash& h, std::vector<BlockHash>* stored) {
  if (pool_[0].cached(page) || prefix_index_.contains(h)) return;
  prefix_index_.emplace(h, page);
  page_hash_[page] = h;
  pool_[0].SetCached(page, true);
  stored->push_back(h);
}

void KvCacheManager::UnindexDevicePageLocked(PageId page) {
  assert(pool_[0].cached(page));
  prefix_index_.erase(page_hash_[page]);
  pool_[0].SetCached(page, false);
  EmitPrefixLocked(KvEventType::kPrefixRemoved, 0, {page_hash_[page]});
}

void KvCacheManager::IndexHostPageLocked(PageId page, const BlockHash& h, std::vector<BlockHash>* stored) {
  if (host_indexed_[page] || !host_index_.emplace(h, page).second) return;
  host_page_hash_[page] = h;
  host_indexed_[page] = 1;
  stored->push_back(h);
}

void KvCacheManager::UnindexHostPageLocked(PageId page) {
  if (!host_indexed_[page]) return;
  host_index_.erase(host_page_hash_[page]);
  host_indexed_[page] = 0;
  host_removed_.push_back(host_page_hash_[page]);
}

void KvCacheManager::FreeTier1PageLocked(PageId page) {
  UnindexHostPageLocked(page);
  pool_[1].DecRef(page);
}

void KvCacheManager::FlushHostRemovedLocked() {
  if (host_removed_.empty()) return;
  EmitPrefixLocked(KvEventType::kPrefixRemoved, 1, std::move(host_removed_));
  host_removed_.clear();
}

void KvCacheManager::EmitPrefixLocked(KvEventType type, int tier, std::vector<BlockHash> hashes) {
  if (hashes.empty()) return;
  const int64_t n = static_cast<int64_t>(hashes.size());
  if (type == KvEventType::kPrefixStored && tier == 0) counters_.prefix_pages_stored += n;
  KvEvent e;
  e.type = type;
  e.pages = n;
  e.hashes = std::move(hashes);
  e.tier = static_cast<int8_t>(tier);
  events_.Append(std::move(e));
}

void KvCacheManager::PublishFullPages(Session& s) {
  const int64_t full = static_cast<int64_t>(s.tokens.size()) / P();
  std::vector<BlockHash> stored[2];
  for (int64_t i = static_cast<int64_t>(s.hashes.size()); i < full; ++i) {
    const BlockHash parent = i == 0 ? BlockHash::Zero() : s.hashes[i - 1];
    const BlockHash h = ComputeBlockHash(parent, options_.model_id, s.tenant,
                                         absl::MakeConstSpan(s.tokens).subspan(i * P(), P()));
    s.hashes.push_back(h);
    const PageLoc loc = s.pages[i];
    if (loc.tier == 0) IndexDevicePageLocked(loc.id, h, &stored[0]);
    if (loc.tier == 1) IndexHostPageLocked(loc.id, h, &stored[1]);  // an import staged there
  }
  EmitPrefixLocked(KvEventType::kPrefixStored, 0, std::move(stored[0]));
  EmitPrefixLocked(KvEventType::kPrefixStored, 1, std::move(stored[1]));
}

PageId KvCacheManager::CopyHostPageLocked(const BlockHash& h, const Session& s) {
  if (!MakeRoom(1, &s, nullptr).ok()) return kNoPage;
  // Looked up after making room, which may have dropped tier-1 pages.
  auto it = host_index_.find(h);
  if (it == host_index_.end()) return kNoPage;
  const PageId src = it->second;
  const PageId dst = pool_[0].Allocate();
  const PageId from[1] = {src};
  const PageId to[1] = {dst};
  absl::Status st = storage_[0]->CopyPages(*storage_[1], from, to);
  absl::StatusOr<PageChecksum> sum = st.ok() ? storage_[0]->Checksum(dst) : absl::StatusOr<PageChecksum>(st);
  if (!sum.ok() || *sum != tier1_checksum_[src]) {
    if (sum.ok()) ++counters_.checksum_failures;
    pool_[0].DecRef(dst);
    UnindexHostPageLocked(src);  // not served again; its own session finds out on its restore
    return kNoPage;
  }
  ++counters_.restores;
  ++counters_.restore_pages;
  counters_.restore_bytes += storage_[0]->page_bytes();
  return dst;
}

absl::StatusOr<int64_t> KvCacheManager::AttachPrefix(const std::string& id, absl::Span<const int32_t> prompt,
                                                     int64_t* restored_tokens) {
  absl::MutexLock l(&mu_);
  KVCACHE_ASSIGN_OR_RETURN(Session * s, Find(id));
  if (s->in_step || s->export_frozen) {
    return absl::FailedPreconditionError(QuoteSession(id) + ": AttachPrefix during a step or export");
  }
  const size_t len = s->tokens.size();
  if (len % P() != 0 || s->reserved != 0 || len > prompt.size() ||
      !std::equal(s->tokens.begin(), s->tokens.end(), prompt.begin())) {
    return absl::FailedPreconditionError(
        QuoteSession(id) + ": AttachPrefix needs a page-aligned session whose tokens start the prompt");
  }
  if (static_cast<int64_t>(prompt.size()) > options_.max_session_tokens) {
    return absl::InvalidArgumentError(QuoteSession(id) + ": prompt longer than max_session_tokens");
  }
  if (!s->prefix_queried) {  // once per session: later calls extend the same lookup
    s->prefix_queried = true;
    counters_.prefix_query_tokens += static_cast<int64_t>(prompt.size());
  }
  BlockHash parent = len == 0 ? BlockHash::Zero() : s->hashes.back();
  const uint64_t epoch = ++write_epoch_;
  int64_t restored = 0;
  std::vector<BlockHash> stored;
  for (size_t i = len / P(); (i + 1) * P() <= prompt.size(); ++i) {
    const auto page_tokens = prompt.subspan(i * P(), P());
    const BlockHash h = ComputeBlockHash(parent, options_.model_id, s->tenant, page_tokens);
    PageId page = kNoPage;
    if (auto it = prefix_index_.find(h); it != prefix_index_.end()) {
      page = it->second;
      pool_[0].IncRef(page);
    } else if (host_index_.contains(h)) {
      s->restoring = true;  // spared by the pressure policy while room is made
      page = CopyHostPageLocked(h, *s);
      s->restoring = false;
      if (page != kNoPage) {
        IndexDevicePageLocked(page, h, &stored);
        ++restored;
      }
    }
    if (page == kNoPage) break;
    s->pages.push_back(PageLoc{0, page});
    s->page_epoch.push_back(epoch);
    s->hashes.push_back(h);
    s->tokens.insert(s->tokens.end(), page_tokens.begin(), page_tokens.end());
    parent = h;
  }
  const int64_t hit = static_cast<int64_t>(s->tokens.size() - len);
  counters_.prefix_hit_tokens += hit;
  if (restored_tokens != nullptr) *restored_tokens = restored * P();
  EmitPrefixLocked(KvEventType::kPrefixStored, 0, std::move(stored));
  FlushHostRemovedLocked();
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
    if (!prefix_index_.contains(parent) && !host_index_.contains(parent)) break;
    hit += P();
  }
  return hit;
}

}  // namespace kvcache::kv
