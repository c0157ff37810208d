#include "worker/kv/kv_transfer.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/kv/session_key.h"

namespace kvcache::kv {
namespace {

constexpr int64_t kSegmentOverhead = 32;  // matches KvChunk::ByteSize()

}  // namespace

// --- export ------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<SessionExporter>> SessionExporter::Create(KvCacheManager* manager,
                                                                         const std::string& session_id,
                                                                         ExportOptions options) {
  if (manager == nullptr) return absl::InvalidArgumentError("null manager");
  if (options.max_chunk_bytes < 1024 || options.max_chunk_bytes > kMaxChunkWireBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_chunk_bytes ", options.max_chunk_bytes, " outside [1 KiB, 4 MiB]"));
  }
  std::unique_ptr<SessionExporter> e(new SessionExporter(manager, options));
  absl::MutexLock l(&manager->mu_);
  KVCACHE_ASSIGN_OR_RETURN(KvCacheManager::Session * s, manager->Find(session_id));
  e->session_id_ = session_id;
  e->uid_ = s->uid;
  e->epoch0_ = manager->write_epoch_;
  const int64_t full = static_cast<int64_t>(s->tokens.size()) / manager->P();
  e->tokens_.assign(s->tokens.begin(), s->tokens.begin() + full * manager->P());
  for (int64_t i = s->first_live; i < full; ++i) e->todo_.push_back(i);
  return e;
}

SessionExporter::~SessionExporter() { Unfreeze(); }

void SessionExporter::Unfreeze() {
  if (!frozen_) return;
  frozen_ = false;
  absl::MutexLock l(&mgr_->mu_);
  auto it = mgr_->sessions_.find(session_id_);
  if (it != mgr_->sessions_.end() && it->second->uid == uid_) it->second->export_frozen = false;
}

absl::StatusOr<KvCacheManager::Session*> SessionExporter::Lookup() {
  auto it = mgr_->sessions_.find(session_id_);
  if (it == mgr_->sessions_.end() || it->second->uid != uid_) {
    return absl::FailedPreconditionError(
        absl::StrCat("export of ", QuoteSession(session_id_), ": the session was closed meanwhile"));
  }
  return it->second.get();
}

absl::StatusOr<bool> SessionExporter::Fill(const KvCacheManager::Session& s, bool bulk, KvChunk* out) {
  const int64_t max = options_.max_chunk_bytes;
  if (token_pos_ < tokens_.size() ||
      (!bulk && token_pos_ == 0 && phase_ == Phase::kFinal && token_base_ < bulk_token_end_)) {
    // Token chunk (in the final phase possibly empty: it tells the receiver to cut).
    out->kind = KvChunk::Kind::kTokens;
    out->token_offset = token_base_ + static_cast<int64_t>(token_pos_);
    const size_t n = std::min(tokens_.size() - token_pos_, static_cast<size_t>((max - 256) / 4));
    out->token_ids.assign(tokens_.begin() + token_pos_, tokens_.begin() + token_pos_ + n);
    token_pos_ += n;
    if (bulk) bulk_token_end_ = token_base_ + static_cast<int64_t>(token_pos_);
    if (!bulk && n == 0) bulk_token_end_ = token_base_;  // the cut was sent
    return true;
  }
  out->kind = KvChunk::Kind::kPages;
  const int64_t page_bytes = mgr_->storage_[0]->page_bytes();
  while (todo_pos_ < todo_.size()) {
    const int64_t idx = todo_[todo_pos_];
    const bool gone = idx >= static_cast<int64_t>(s.pages.size()) || idx < s.first_live ||
                      s.pages[idx].tier < 0 || (bulk && s.page_epoch[idx] > epoch0_);
    if (gone) {  // released or rewritten since Create(): the final phase handles it
      ++todo_pos_;
      page_offset_ = 0;
      continue;
    }
    if (page_offset_ == 0) {
      KVCACHE_ASSIGN_OR_RETURN(page_sum_, mgr_->PageChecksumLocked(s, idx));
    }
    const int64_t room = max - out->ByteSize() - kSegmentOverhead;
    const int64_t remaining = page_bytes - page_offset_;
    // Keep pages whole when they fit a chunk of their own.
    if (room <= 0 ||
        (room < remaining && !out->payload.empty() && remaining <= max - 128 - 2 * kSegmentOverhead)) {
      break;
    }
    const int64_t len = std::min(room, remaining);
    const size_t at = out->payload.size();
    out->payload.resize(at + static_cast<size_t>(len));
    const KvCacheManager::PageLoc loc = s.pages[idx];
    KVCACHE_RETURN_IF_ERROR(mgr_->storage_[loc.tier]->ReadPage(
        loc.id, page_offset_, absl::MakeSpan(out->payload).subspan(at, len)));
    out->segments.push_back(PageSegment{idx, page_offset_, len, page_sum_});
    page_offset_ += len;
    if (page_offset_ == page_bytes) {
      if (static_cast<int64_t>(sent_ok_.size()) <= idx) {
        sent_ok_.resize(idx + 1, 0);
        sent_sum_.resize(idx + 1, 0);
      }
      sent_ok_[idx] = 1;
      sent_sum_[idx] = page_sum_;
      ++(bulk ? bulk_pages_ : final_pages_);
      ++todo_pos_;
      page_offset_ = 0;
    }
  }
  return !out->segments.empty();
}

absl::StatusOr<bool> SessionExporter::NextBulk(KvChunk* out) {
  *out = KvChunk{};
  absl::MutexLock l(&mgr_->mu_);
  KVCACHE_ASSIGN_OR_RETURN(KvCacheManager::Session * s, Lookup());
  if (phase_ == Phase::kBegin) {
    out->kind = KvChunk::Kind::kBegin;
    out->session_id = s->id;
    out->tenant = s->tenant;
    out->model_id = mgr_->options_.model_id;
    out->shape = mgr_->options_.shape;
    phase_ = Phase::kBulk;
    return true;
  }
  if (phase_ != Phase::kBulk) return false;
  KVCACHE_ASSIGN_OR_RETURN(bool more, Fill(*s, /*bulk=*/true, out));
  if (!more) phase_ = Phase::kFinalStart;
  return more;
}

absl::StatusOr<bool> SessionExporter::NextFinal(KvChunk* out) {
  *out = KvChunk{};
  if (phase_ == Phase::kBegin) {  // no bulk phase: the kBegin chunk comes first
    KVCACHE_ASSIGN_OR_RETURN(bool begun, NextBulk(out));
    phase_ = Phase::kFinalStart;
    return begun;
  }
  absl::MutexLock l(&mgr_->mu_);
  if (phase_ == Phase::kDone) return false;
  KVCACHE_ASSIGN_OR_RETURN(KvCacheManager::Session * s, Lookup());
  if (phase_ == Phase::kBulk || phase_ == Phase::kFinalStart) {
    if (s->in_step) {
      return absl::FailedPreconditionError(
          absl::StrCat("export of ", QuoteSession(session_id_), ": final phase must run between steps"));
    }
    s->export_frozen = true;
    frozen_ = true;
    // Tokens: resend from the first position that differs from what bulk sent.
    const int64_t len = static_cast<int64_t>(s->tokens.size());
    int64_t d = 0;
    const int64_t same = std::min(bulk_token_end_, len);
    while (d < same && s->tokens[d] == tokens_[d]) ++d;
    tokens_.assign(s->tokens.begin() + d, s->tokens.end());
    token_base_ = d;
    token_pos_ = 0;
    // Pages: every live page not sent whole, or written since Create().
    todo_.clear();
    todo_pos_ = 0;
    page_offset_ = 0;
    for (int64_t i = s->first_live; i < mgr_->PagesFor(len); ++i) {
      const bool sent = i < static_cast<int64_t>(sent_ok_.size()) && sent_ok_[i];
      if (!sent || s->page_epoch[i] > epoch0_) todo_.push_back(i);
    }
    phase_ = Phase::kFinal;
  }
  KVCACHE_ASSIGN_OR_RETURN(bool more, Fill(*s, /*bulk=*/false, out));
  if (more) return true;
  // Commit chunk: every live page's checksum.
  out->kind = KvChunk::Kind::kCommit;
  out->num_tokens = static_cast<int64_t>(s->tokens.size());
  out->first_live_page = s->first_live;
  for (int64_t i = s->first_live; i < mgr_->PagesFor(out->num_tokens); ++i) {
    if (i >= static_cast<int64_t>(sent_ok_.size()) || !sent_ok_[i]) {
      return absl::InternalError(
          absl::StrCat("export of ", QuoteSession(session_id_), ": page ", i, " was never sent"));
    }
    out->page_checksums.push_back(sent_sum_[i]);
  }
  if (out->ByteSize() > kMaxChunkWireBytes) {
    return absl::OutOfRangeError(
        absl::StrCat("export of ", QuoteSession(session_id_), ": commit chunk exceeds 4 MiB"));
  }
  s->export_frozen = false;
  frozen_ = false;
  phase_ = Phase::kDone;
  mgr_->Emit(KvEventType::kSessionExported, s, static_cast<int64_t>(out->page_checksums.size()));
  return true;
}

absl::StatusOr<std::vector<KvChunk>> ExportSession(KvCacheManager* manager, const std::string& session_id,
                                                   ExportOptions options) {
  KVCACHE_ASSIGN_OR_RETURN(auto exporter, SessionExporter::Create(manager, session_id, options));
  std::vector<KvChunk> chunks;
  KvChunk c;
  while (true) {
    KVCACHE_ASSIGN_OR_RETURN(bool more, exporter->NextBulk(&c));
    if (!more) break;
    chunks.push_back(std::move(c));
  }
  while (true) {
    KVCACHE_ASSIGN_OR_RETURN(bool more, exporter->NextFinal(&c));
    if (!more) break;
    chunks.push_back(std::move(c));
  }
  return chunks;
}

// --- import ------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<SessionImporter>> SessionImporter::Create(KvCacheManager* manager,
                                                                         ImportOptions options) {
  if (manager == nullptr) return absl::InvalidArgumentError("null manager");
  return std::unique_ptr<SessionImporter>(new SessionImporter(manager, std::move(options)));
}

SessionImporter::~SessionImporter() {
  absl::MutexLock l(&mgr_->mu_);
  AbortLocked();
}

void SessionImporter::AbortLocked() {
  if (committed_) return;
  for (Staged& p : staged_) {
    if (p.id == kNoPage) continue;
    mgr_->pool_[0].FreeStaging(p.id);
    --mgr_->staging_pages_;
    p = Staged{};
  }
  staged_.clear();
  tokens_.clear();
}

absl::Status SessionImporter::Add(const KvChunk& chunk) {
  absl::MutexLock l(&mgr_->mu_);
  if (committed_) return absl::FailedPreconditionError(QuoteSession(session_id_) + " already imported");
  if (!failed_.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("import of ", QuoteSession(session_id_), " was aborted: ", failed_.message()));
  }
  absl::Status st = AddLocked(chunk);
  if (!st.ok()) {
    AbortLocked();
    failed_ = st;
  }
  return st;
}

absl::Status SessionImporter::AddLocked(const KvChunk& c) {
  const KvCacheOptions& opt = mgr_->options_;
  if (c.kind == KvChunk::Kind::kBegin) {
    if (began_) return absl::InvalidArgumentError("import: second kBegin chunk");
    session_id_ = options_.session_id.empty() ? c.session_id : options_.session_id;
    tenant_ = c.tenant;
    if (session_id_.empty() || tenant_.empty()) {
      return absl::InvalidArgumentError("import: empty session id or tenant");
    }
    if (c.model_id != opt.model_id) {
      return absl::FailedPreconditionError(absl::StrCat("import of ", QuoteSession(session_id_), ": model '",
                                                        c.model_id, "' differs from '", opt.model_id, "'"));
    }
    if (c.shape != opt.shape) {
      return absl::FailedPreconditionError(absl::StrCat("import of ", QuoteSession(session_id_), ": shape ",
                                                        c.shape.DebugString(), " differs from ",
                                                        opt.shape.DebugString()));
    }
    if (mgr_->sessions_.contains(session_id_)) {
      return absl::AlreadyExistsError(QuoteSession(session_id_) + " already exists");
    }
    began_ = true;
    return absl::OkStatus();
  }
  if (!began_) return absl::InvalidArgumentError("import: chunk before kBegin");
  switch (c.kind) {
    case KvChunk::Kind::kTokens: {
      const int64_t end = c.token_offset + static_cast<int64_t>(c.token_ids.size());
      if (c.token_offset < 0 || c.token_offset > static_cast<int64_t>(tokens_.size()) ||
          end > opt.max_session_tokens) {
        return absl::InvalidArgumentError(
            absl::StrCat("import of ", QuoteSession(session_id_), ": token chunk at ", c.token_offset,
                         " does not continue the ", tokens_.size(), " tokens received"));
      }
      tokens_.resize(c.token_offset);
      tokens_.insert(tokens_.end(), c.token_ids.begin(), c.token_ids.end());
      return absl::OkStatus();
    }
    case KvChunk::Kind::kPages:
      return AddPages(c);
    case KvChunk::Kind::kCommit:
      return CommitLocked(c);
    case KvChunk::Kind::kBegin:
      break;
  }
  return absl::InvalidArgumentError("import: unknown chunk kind");
}

absl::Status SessionImporter::AddPages(const KvChunk& c) {
  const int64_t page_bytes = mgr_->storage_[0]->page_bytes();
  const int64_t max_pages = mgr_->PagesFor(mgr_->options_.max_session_tokens);
  int64_t total = 0;
  for (const PageSegment& seg : c.segments) {
    if (seg.page_index < 0 || seg.page_index >= max_pages || seg.offset < 0 || seg.length <= 0 ||
        seg.offset + seg.length > page_bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("import of ", QuoteSession(session_id_), ": bad segment for page ", seg.page_index));
    }
    total += seg.length;
  }
  if (total != static_cast<int64_t>(c.payload.size())) {
    return absl::InvalidArgumentError(absl::StrCat("import of ", QuoteSession(session_id_), ": payload is ",
                                                   c.payload.size(), " bytes, segments say ", total));
  }
  int64_t at = 0;
  for (const PageSegment& seg : c.segments) {
    if (static_cast<int64_t>(staged_.size()) <= seg.page_index) staged_.resize(seg.page_index + 1);
    Staged& p = staged_[seg.page_index];
    if (seg.offset == 0) {
      p.received = 0;
      p.verified = false;
      p.sum = seg.page_checksum;
    } else if (seg.offset != p.received || seg.page_checksum != p.sum) {
      return absl::InvalidArgumentError(absl::StrCat("import of ", QuoteSession(session_id_),
                                                     ": segment of page ", seg.page_index, " at ", seg.offset,
                                                     " does not continue its ", p.received, " bytes"));
    }
    if (p.id == kNoPage) {
      KVCACHE_RETURN_IF_ERROR(mgr_->MakeRoom(1, nullptr, nullptr));
      p.id = mgr_->pool_[0].Allocate(/*staging=*/true);
      ++mgr_->staging_pages_;
    }
    KVCACHE_RETURN_IF_ERROR(mgr_->storage_[0]->WritePage(
        p.id, seg.offset, absl::MakeConstSpan(c.payload).subspan(at, seg.length)));
    at += seg.length;
    p.received += seg.length;
    if (p.received == page_bytes) {
      KVCACHE_ASSIGN_OR_RETURN(PageChecksum sum, mgr_->storage_[0]->Checksum(p.id));
      if (sum != p.sum) {
        ++mgr_->counters_.checksum_failures;
        return absl::DataLossError(absl::StrCat("import of ", QuoteSession(session_id_), ": page ",
                                                seg.page_index, " checksum mismatch"));
      }
      p.verified = true;
    }
  }
  return absl::OkStatus();
}

absl::Status SessionImporter::CommitLocked(const KvChunk& c) {
  const KvCacheOptions& opt = mgr_->options_;
  const int64_t len = static_cast<int64_t>(tokens_.size());
  const std::string who = absl::StrCat("import of ", QuoteSession(session_id_), ": ");
  if (c.num_tokens != len) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, "commit says ", c.num_tokens, " tokens, received ", len));
  }
  const int64_t w = opt.shape.sliding_window;
  const int64_t first_live = (w > 0 && len > w) ? (len - w) / mgr_->P() : 0;
  const int64_t n_pages = mgr_->PagesFor(len);
  if (c.first_live_page != first_live ||
      static_cast<int64_t>(c.page_checksums.size()) != n_pages - first_live) {
    return absl::InvalidArgumentError(absl::StrCat(who, "commit lists pages [", c.first_live_page, ", +",
                                                   c.page_checksums.size(), "), expected [", first_live, ", ",
                                                   n_pages, ")"));
  }
  for (int64_t i = first_live; i < n_pages; ++i) {
    if (i >= static_cast<int64_t>(staged_.size()) || !staged_[i].verified) {
      return absl::InvalidArgumentError(absl::StrCat(who, "page ", i, " missing"));
    }
    if (staged_[i].sum != c.page_checksums[i - first_live]) {
      ++mgr_->counters_.checksum_failures;
      return absl::DataLossError(absl::StrCat(who, "page ", i, " checksum differs from commit"));
    }
  }
  if (mgr_->sessions_.contains(session_id_)) {
    return absl::AlreadyExistsError(QuoteSession(session_id_) + " already exists");
  }
  // Verified: apply. Nothing below can fail.
  auto s = std::make_unique<KvCacheManager::Session>();
  s->uid = mgr_->next_uid_++;
  s->id = session_id_;
  s->tenant = tenant_;
  s->tokens = std::move(tokens_);
  s->first_live = first_live;
  s->pages.resize(n_pages);
  s->page_epoch.assign(n_pages, ++mgr_->write_epoch_);
  for (int64_t i = 0; i < static_cast<int64_t>(staged_.size()); ++i) {
    Staged& p = staged_[i];
    if (p.id == kNoPage) continue;
    if (i >= first_live && i < n_pages) {
      mgr_->pool_[0].CommitStaging(p.id);
      s->pages[i] = KvCacheManager::PageLoc{0, p.id};
    } else {
      mgr_->pool_[0].FreeStaging(p.id);
    }
    --mgr_->staging_pages_;
    p = Staged{};
  }
  staged_.clear();
  committed_ = true;
  mgr_->closed_ids_.erase(session_id_);
  mgr_->Touch(*s);
  KvCacheManager::Session* raw = s.get();
  mgr_->sessions_.emplace(session_id_, std::move(s));
  mgr_->Emit(KvEventType::kSessionPlaced, raw, n_pages - first_live);
  mgr_->PublishFullPages(*raw);
  return absl::OkStatus();
}

absl::Status ImportSession(KvCacheManager* manager, absl::Span<const KvChunk> chunks, ImportOptions options) {
  KVCACHE_ASSIGN_OR_RETURN(auto importer, SessionImporter::Create(manager, std::move(options)));
  for (const KvChunk& c : chunks) KVCACHE_RETURN_IF_ERROR(importer->Add(c));
  if (!importer->committed()) {
    return absl::InvalidArgumentError("import: the chunks ended without a kCommit chunk");
  }
  return absl::OkStatus();
}

}  // namespace kvcache::kv
