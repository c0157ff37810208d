// KvCacheManager: the transfer port (kv_transfer_port.h), the only way export and
// import reach the manager's sessions and pages.
#include <algorithm>
#include <memory>
#include <utility>

#include "absl/algorithm/container.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/kv/kv_cache_manager.h"
#include "worker/kv/session_key.h"

namespace kvcache::kv {

const KvShape& KvCacheManager::TransferPort::shape() const { return m_->options_.shape; }
const std::string& KvCacheManager::TransferPort::model_id() const { return m_->options_.model_id; }
int64_t KvCacheManager::TransferPort::max_session_tokens() const { return m_->options_.max_session_tokens; }

// --- helpers -------------------------------------------------------------------

absl::StatusOr<KvCacheManager::Session*> KvCacheManager::TransferPort::Lookup(const ExportHandle& h) {
  auto it = m_->sessions_.find(h.session_id);
  if (it == m_->sessions_.end() || it->second->uid != h.uid) {
    return absl::FailedPreconditionError(
        absl::StrCat("export of ", QuoteSession(h.session_id), ": the session was closed meanwhile"));
  }
  return it->second.get();
}

ExportView KvCacheManager::TransferPort::ViewOf(const Session& s) const {
  ExportView v;
  v.handle = ExportHandle{s.id, s.uid};
  v.tenant = s.tenant;
  v.tokens = s.tokens;
  v.first_live_page = s.first_live;
  v.page_epoch = s.page_epoch;
  v.write_epoch = m_->write_epoch_;
  return v;
}

bool KvCacheManager::TransferPort::IsStaging(StagingPage page) const {
  return (page.tier == 0 || page.tier == 1) && m_->pool_[page.tier].Valid(page.id) &&
         m_->pool_[page.tier].IsStaging(page.id);
}

void KvCacheManager::TransferPort::FreeStagingLocked(absl::Span<const StagingPage> pages) {
  for (const StagingPage page : pages) {
    if (!IsStaging(page)) continue;
    m_->pool_[page.tier].FreeStaging(page.id);
    --m_->staging_pages_[page.tier];
  }
}

// --- export ----------------------------------------------------------------------

absl::StatusOr<ExportView> KvCacheManager::TransferPort::OpenExport(const std::string& session_id) {
  absl::MutexLock l(&m_->mu_);
  KVCACHE_ASSIGN_OR_RETURN(const Session* s, m_->Find(session_id));
  return ViewOf(*s);
}

absl::StatusOr<ExportExtent> KvCacheManager::TransferPort::CheckExport(const ExportHandle& h) {
  absl::MutexLock l(&m_->mu_);
  KVCACHE_ASSIGN_OR_RETURN(const Session* s, Lookup(h));
  return ExportExtent{static_cast<int64_t>(s->tokens.size()), s->first_live};
}

absl::StatusOr<bool> KvCacheManager::TransferPort::ReadPage(const ExportHandle& h, int64_t index,
                                                            uint64_t max_epoch, int64_t offset,
                                                            absl::Span<uint8_t> out, PageChecksum* sum) {
  const int64_t page_bytes = m_->storage_[0]->page_bytes();
  if (offset < 0 || offset + static_cast<int64_t>(out.size()) > page_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("export of ", QuoteSession(h.session_id), ": bytes [",
                                                   offset, ", +", out.size(), ") leave a page of ",
                                                   page_bytes));
  }
  absl::MutexLock l(&m_->mu_);
  KVCACHE_ASSIGN_OR_RETURN(const Session* s, Lookup(h));
  if (index < s->first_live || index >= static_cast<int64_t>(s->pages.size()) || s->pages[index].tier < 0 ||
      s->page_epoch[index] > max_epoch) {
    return false;
  }
  if (sum != nullptr) {
    KVCACHE_ASSIGN_OR_RETURN(*sum, m_->PageChecksumLocked(*s, index));
  }
  const PageLoc loc = s->pages[index];
  KVCACHE_RETURN_IF_ERROR(m_->storage_[loc.tier]->ReadPage(loc.id, offset, out));
  return true;
}

absl::StatusOr<ExportView> KvCacheManager::TransferPort::FreezeExport(const ExportHandle& h) {
  absl::MutexLock l(&m_->mu_);
  KVCACHE_ASSIGN_OR_RETURN(Session * s, Lookup(h));
  if (s->in_step) {
    return absl::FailedPreconditionError(
        absl::StrCat("export of ", QuoteSession(h.session_id), ": final phase must run between steps"));
  }
  s->export_frozen = true;
  return ViewOf(*s);
}

absl::Status KvCacheManager::TransferPort::FinishExport(const ExportHandle& h, int64_t exported_pages) {
  absl::MutexLock l(&m_->mu_);
  KVCACHE_ASSIGN_OR_RETURN(Session * s, Lookup(h));
  s->export_frozen = false;
  m_->Emit(KvEventType::kSessionExported, s, exported_pages);
  return absl::OkStatus();
}

void KvCacheManager::TransferPort::UnfreezeExport(const ExportHandle& h) {
  absl::MutexLock l(&m_->mu_);
  absl::StatusOr<Session*> s = Lookup(h);
  if (s.ok()) (*s)->export_frozen = false;
}

// --- import ----------------------------------------------------------------------

absl::Status KvCacheManager::TransferPort::CheckImportId(const std::string& session_id) {
  absl::MutexLock l(&m_->mu_);
  if (m_->sessions_.contains(session_id)) {
    return absl::AlreadyExistsError(QuoteSession(session_id) + " already exists");
  }
  return absl::OkStatus();
}

absl::StatusOr<StagingPage> KvCacheManager::TransferPort::AllocateStaging() {
  absl::MutexLock l(&m_->mu_);
  int tier = 0;
  if (absl::Status room = m_->MakeRoom(1, nullptr, nullptr); !room.ok()) {
    // Tier 0 is held by sessions that cannot move now. A session arriving by
    // migration is better offloaded here than lost to its source's shutdown.
    if (!absl::IsResourceExhausted(room)) return room;
    if (m_->pool_[1].num_free() == 0) m_->DropTier1(1, nullptr);
    if (m_->pool_[1].num_free() == 0) {
      return absl::ResourceExhaustedError(absl::StrCat(room.message(), ", and tier 1 has no page to give"));
    }
    tier = 1;
  }
  const PageId page = m_->pool_[tier].Allocate(/*staging=*/true);
  ++m_->staging_pages_[tier];
  return StagingPage{tier, page};
}

absl::Status KvCacheManager::TransferPort::WriteStaging(StagingPage page, int64_t offset,
                                                        absl::Span<const uint8_t> bytes) {
  absl::MutexLock l(&m_->mu_);
  if (!IsStaging(page)) {
    return absl::InvalidArgumentError(absl::StrCat("tier-", page.tier, " page ", page.id, " is not staging"));
  }
  if (offset < 0 || offset + static_cast<int64_t>(bytes.size()) > m_->storage_[page.tier]->page_bytes()) {
    return absl::InvalidArgumentError(
        absl::StrCat("bytes [", offset, ", +", bytes.size(), ") leave staging page ", page.id));
  }
  return m_->storage_[page.tier]->WritePage(page.id, offset, bytes);
}

absl::StatusOr<PageChecksum> KvCacheManager::TransferPort::StagingChecksum(StagingPage page) {
  absl::MutexLock l(&m_->mu_);
  if (!IsStaging(page)) {
    return absl::InvalidArgumentError(absl::StrCat("tier-", page.tier, " page ", page.id, " is not staging"));
  }
  return m_->storage_[page.tier]->Checksum(page.id);
}

void KvCacheManager::TransferPort::CountChecksumFailure() {
  absl::MutexLock l(&m_->mu_);
  ++m_->counters_.checksum_failures;
}

void KvCacheManager::TransferPort::FreeStaging(absl::Span<const StagingPage> pages) {
  absl::MutexLock l(&m_->mu_);
  FreeStagingLocked(pages);
}

absl::Status KvCacheManager::TransferPort::CommitImport(ImportedSession in) {
  absl::MutexLock l(&m_->mu_);
  const std::string who = absl::StrCat("import of ", QuoteSession(in.session_id), ": ");
  const int64_t len = static_cast<int64_t>(in.tokens.size());
  const int64_t w = m_->options_.shape.sliding_window;
  const int64_t first_live = (w > 0 && len > w) ? (len - w) / m_->P() : 0;
  const int64_t n_pages = m_->PagesFor(len);
  absl::Status bad;
  if (in.session_id.empty() || in.tenant.empty()) {
    bad = absl::InvalidArgumentError("import: empty session id or tenant");
  } else if (len > m_->options_.max_session_tokens) {
    bad = absl::InvalidArgumentError(absl::StrCat(who, len, " tokens exceed max_session_tokens"));
  } else if (in.first_live_page != first_live) {
    bad = absl::InvalidArgumentError(
        absl::StrCat(who, "first live page ", in.first_live_page, ", the window implies ", first_live));
  }
  absl::flat_hash_set<std::pair<int, PageId>> seen;
  // A tier-1 page's checksum, which a restore verifies, is taken before anything
  // changes: it is the one step that can fail.
  std::vector<PageChecksum> tier1_sums(in.staged.size());
  for (int64_t i = 0; i < static_cast<int64_t>(in.staged.size()) && bad.ok(); ++i) {
    const StagingPage page = in.staged[i];
    if (page.id == kNoPage) {
      if (i >= first_live && i < n_pages) {
        bad = absl::InvalidArgumentError(absl::StrCat(who, "page ", i, " missing"));
      }
    } else if (!IsStaging(page) || !seen.insert({page.tier, page.id}).second) {
      bad = absl::InvalidArgumentError(absl::StrCat(who, "page ", i, " is not a staging page of its own"));
    } else if (page.tier == 1 && i >= first_live && i < n_pages) {
      absl::StatusOr<PageChecksum> sum = m_->storage_[1]->Checksum(page.id);
      if (sum.ok()) {
        tier1_sums[i] = *sum;
      } else {
        bad = sum.status();
      }
    }
  }
  if (bad.ok() && static_cast<int64_t>(in.staged.size()) < n_pages) {
    const int64_t missing = std::max<int64_t>(static_cast<int64_t>(in.staged.size()), first_live);
    bad = absl::InvalidArgumentError(absl::StrCat(who, "page ", missing, " missing"));
  }
  if (bad.ok() && m_->sessions_.contains(in.session_id)) {
    bad = absl::AlreadyExistsError(QuoteSession(in.session_id) + " already exists");
  }
  // Pages staged in tier 1 come back on the session's next step, into what
  // pinned sessions leave of tier 0 (they never leave it): a session larger
  // than that could never run here, and belongs on another worker.
  if (bad.ok() &&
      absl::c_any_of(in.staged, [](const StagingPage& p) { return p.id != kNoPage && p.tier == 1; })) {
    int64_t pinned = 0;
    for (const auto& [id, other] : m_->sessions_) {
      if (other->user_pinned) pinned += static_cast<int64_t>(other->pages.size()) - other->first_live;
    }
    const int64_t room = m_->pool_[0].capacity() - pinned;
    if (n_pages - first_live > room) {
      bad = absl::ResourceExhaustedError(absl::StrCat(
          who, n_pages - first_live, " pages could never be restored here: pinned sessions hold ", pinned,
          " of the ", m_->pool_[0].capacity(), " tier-0 pages"));
    }
  }
  if (!bad.ok()) {
    FreeStagingLocked(in.staged);
    return bad;
  }
  // Verified: apply. Nothing below can fail.
  auto s = std::make_unique<Session>();
  s->uid = m_->next_uid_++;
  s->id = in.session_id;
  s->tenant = std::move(in.tenant);
  s->tokens = std::move(in.tokens);
  s->first_live = first_live;
  s->pages.resize(n_pages);
  s->page_epoch.assign(n_pages, ++m_->write_epoch_);
  for (int64_t i = 0; i < static_cast<int64_t>(in.staged.size()); ++i) {
    const StagingPage page = in.staged[i];
    if (page.id == kNoPage) continue;
    if (i >= first_live && i < n_pages) {
      m_->pool_[page.tier].CommitStaging(page.id);
      s->pages[i] = PageLoc{static_cast<int8_t>(page.tier), page.id};
      if (page.tier == 1) {
        m_->tier1_checksum_[page.id] = tier1_sums[i];
        ++s->tier1_pages;
      }
    } else {
      m_->pool_[page.tier].FreeStaging(page.id);
    }
    --m_->staging_pages_[page.tier];
  }
  m_->closed_ids_.erase(in.session_id);
  m_->Touch(*s);
  Session* raw = s.get();
  m_->sessions_.emplace(in.session_id, std::move(s));
  m_->Emit(KvEventType::kSessionPlaced, raw, n_pages - first_live);
  if (raw->tier1_pages > 0) m_->Emit(KvEventType::kSessionOffloaded, raw, raw->tier1_pages);
  m_->PublishFullPages(*raw);
  return absl::OkStatus();
}

}  // namespace kvcache::kv
