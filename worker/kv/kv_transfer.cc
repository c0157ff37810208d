#include "worker/kv/kv_transfer.h"

#include <algorithm>
#include <utility>

#include "absl/algorithm/container.h"
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
  KvTransferPort& port = manager->transfer_port();
  std::unique_ptr<SessionExporter> e(new SessionExporter(&port, options));
  KVCACHE_ASSIGN_OR_RETURN(ExportView v, port.OpenExport(session_id));
  e->session_ = std::move(v.handle);
  e->tenant_ = std::move(v.tenant);
  e->epoch0_ = v.write_epoch;
  const int64_t p = port.shape().page_tokens;
  const int64_t full = static_cast<int64_t>(v.tokens.size()) / p;
  v.tokens.resize(full * p);
  e->tokens_ = std::move(v.tokens);
  for (int64_t i = v.first_live_page; i < full; ++i) e->todo_.push_back(i);
  return e;
}

SessionExporter::~SessionExporter() { Unfreeze(); }

void SessionExporter::Unfreeze() {
  if (!frozen_) return;
  frozen_ = false;
  port_->UnfreezeExport(session_);
}

absl::StatusOr<bool> SessionExporter::Fill(bool bulk, KvChunk* out) {
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
  const int64_t page_bytes = port_->shape().page_bytes();
  while (todo_pos_ < todo_.size()) {
    const int64_t idx = todo_[todo_pos_];
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
    // The checksum is taken with a page's first segment, under the same lock hold.
    KVCACHE_ASSIGN_OR_RETURN(const bool live,
                             port_->ReadPage(session_, idx, bulk ? epoch0_ : kAnyEpoch, page_offset_,
                                             absl::MakeSpan(out->payload).subspan(at, len),
                                             page_offset_ == 0 ? &page_sum_ : nullptr));
    if (!live) {  // released or rewritten since Create(): the final phase handles it
      out->payload.resize(at);
      ++todo_pos_;
      page_offset_ = 0;
      continue;
    }
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
  KVCACHE_RETURN_IF_ERROR(port_->CheckExport(session_).status());
  if (phase_ == Phase::kBegin) {
    out->kind = KvChunk::Kind::kBegin;
    out->session_id = session_.session_id;
    out->tenant = tenant_;
    out->model_id = port_->model_id();
    out->shape = port_->shape();
    phase_ = Phase::kBulk;
    return true;
  }
  if (phase_ != Phase::kBulk) return false;
  KVCACHE_ASSIGN_OR_RETURN(bool more, Fill(/*bulk=*/true, out));
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
  if (phase_ == Phase::kDone) return false;
  ExportExtent extent;
  if (phase_ == Phase::kBulk || phase_ == Phase::kFinalStart) {
    KVCACHE_ASSIGN_OR_RETURN(ExportView v, port_->FreezeExport(session_));
    frozen_ = true;
    // Tokens: resend from the first position that differs from what bulk sent.
    const int64_t len = static_cast<int64_t>(v.tokens.size());
    int64_t d = 0;
    const int64_t same = std::min(bulk_token_end_, len);
    while (d < same && v.tokens[d] == tokens_[d]) ++d;
    tokens_.assign(v.tokens.begin() + d, v.tokens.end());
    token_base_ = d;
    token_pos_ = 0;
    // Pages: every live page not sent whole, or written since Create().
    todo_.clear();
    todo_pos_ = 0;
    page_offset_ = 0;
    const int64_t p = port_->shape().page_tokens;
    for (int64_t i = v.first_live_page; i < (len + p - 1) / p; ++i) {
      const bool sent = i < static_cast<int64_t>(sent_ok_.size()) && sent_ok_[i];
      if (!sent || v.page_epoch[i] > epoch0_) todo_.push_back(i);
    }
    phase_ = Phase::kFinal;
    extent = ExportExtent{len, v.first_live_page};
  } else {
    KVCACHE_ASSIGN_OR_RETURN(extent, port_->CheckExport(session_));
  }
  KVCACHE_ASSIGN_OR_RETURN(bool more, Fill(/*bulk=*/false, out));
  if (more) return true;
  // Commit chunk: every live page's checksum. The session is frozen: `extent` is
  // still its extent.
  out->kind = KvChunk::Kind::kCommit;
  out->num_tokens = extent.num_tokens;
  out->first_live_page = extent.first_live_page;
  const int64_t p = port_->shape().page_tokens;
  for (int64_t i = extent.first_live_page; i < (extent.num_tokens + p - 1) / p; ++i) {
    if (i >= static_cast<int64_t>(sent_ok_.size()) || !sent_ok_[i]) {
      return absl::InternalError(
          absl::StrCat("export of ", QuoteSession(session_.session_id), ": page ", i, " was never sent"));
    }
    out->page_checksums.push_back(sent_sum_[i]);
  }
  if (out->ByteSize() > kMaxChunkWireBytes) {
    return absl::OutOfRangeError(
        absl::StrCat("export of ", QuoteSession(session_.session_id), ": commit chunk exceeds 4 MiB"));
  }
  KVCACHE_RETURN_IF_ERROR(port_->FinishExport(session_, static_cast<int64_t>(out->page_checksums.size())));
  frozen_ = false;
  phase_ = Phase::kDone;
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
  return std::unique_ptr<SessionImporter>(new SessionImporter(&manager->transfer_port(), std::move(options)));
}

SessionImporter::~SessionImporter() { Abort(); }

void SessionImporter::Abort() {
  if (committed_) return;
  std::vector<StagingPage> pages;
  for (const Staged& p : staged_) {
    if (p.page.id != kNoPage) pages.push_back(p.page);
  }
  if (!pages.empty()) port_->FreeStaging(pages);
  staged_.clear();
  tokens_.clear();
}

int64_t SessionImporter::staged_pages(int tier) const {
  return std::count_if(staged_.begin(), staged_.end(),
                       [tier](const Staged& s) { return s.page.id != kNoPage && s.page.tier == tier; });
}

absl::Status SessionImporter::Add(const KvChunk& chunk) {
  if (committed_) return absl::FailedPreconditionError(QuoteSession(session_id_) + " already imported");
  if (!failed_.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("import of ", QuoteSession(session_id_), " was aborted: ", failed_.message()));
  }
  absl::Status st = AddChunk(chunk);
  if (!st.ok()) {
    Abort();
    failed_ = st;
  }
  return st;
}

absl::Status SessionImporter::AddChunk(const KvChunk& c) {
  if (c.kind == KvChunk::Kind::kBegin) {
    if (began_) return absl::InvalidArgumentError("import: second kBegin chunk");
    session_id_ = options_.session_id.empty() ? c.session_id : options_.session_id;
    tenant_ = c.tenant;
    if (session_id_.empty() || tenant_.empty()) {
      return absl::InvalidArgumentError("import: empty session id or tenant");
    }
    if (c.model_id != port_->model_id()) {
      return absl::FailedPreconditionError(absl::StrCat("import of ", QuoteSession(session_id_), ": model '",
                                                        c.model_id, "' differs from '", port_->model_id(),
                                                        "'"));
    }
    if (c.shape != port_->shape()) {
      return absl::FailedPreconditionError(absl::StrCat("import of ", QuoteSession(session_id_), ": shape ",
                                                        c.shape.DebugString(), " differs from ",
                                                        port_->shape().DebugString()));
    }
    KVCACHE_RETURN_IF_ERROR(port_->CheckImportId(session_id_));
    began_ = true;
    return absl::OkStatus();
  }
  if (!began_) return absl::InvalidArgumentError("import: chunk before kBegin");
  switch (c.kind) {
    case KvChunk::Kind::kTokens: {
      const int64_t end = c.token_offset + static_cast<int64_t>(c.token_ids.size());
      if (c.token_offset < 0 || c.token_offset > static_cast<int64_t>(tokens_.size()) ||
          end > port_->max_session_tokens()) {
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
      return Commit(c);
    case KvChunk::Kind::kBegin:
      break;
  }
  return absl::InvalidArgumentError("import: unknown chunk kind");
}

absl::Status SessionImporter::AddPages(const KvChunk& c) {
  const int64_t page_bytes = port_->shape().page_bytes();
  const int64_t p = port_->shape().page_tokens;
  const int64_t max_pages = (port_->max_session_tokens() + p - 1) / p;
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
    Staged& sp = staged_[seg.page_index];
    if (seg.offset == 0) {
      sp.received = 0;
      sp.verified = false;
      sp.sum = seg.page_checksum;
    } else if (seg.offset != sp.received || seg.page_checksum != sp.sum) {
      return absl::InvalidArgumentError(absl::StrCat("import of ", QuoteSession(session_id_),
                                                     ": segment of page ", seg.page_index, " at ", seg.offset,
                                                     " does not continue its ", sp.received, " bytes"));
    }
    if (sp.page.id == kNoPage) {
      absl::StatusOr<StagingPage> page = port_->AllocateStaging();
      if (!page.ok()) {
        const int64_t held =
            absl::c_count_if(staged_, [](const Staged& st) { return st.page.id != kNoPage; });
        return absl::Status(
            page.status().code(),
            absl::StrCat("import of ", QuoteSession(session_id_), " (", tokens_.size(),
                         " tokens): no room with ", held, " of its pages staged: ", page.status().message()));
      }
      sp.page = *page;
    }
    KVCACHE_RETURN_IF_ERROR(
        port_->WriteStaging(sp.page, seg.offset, absl::MakeConstSpan(c.payload).subspan(at, seg.length)));
    at += seg.length;
    sp.received += seg.length;
    if (sp.received == page_bytes) {
      KVCACHE_ASSIGN_OR_RETURN(PageChecksum sum, port_->StagingChecksum(sp.page));
      if (sum != sp.sum) {
        port_->CountChecksumFailure();
        return absl::DataLossError(absl::StrCat("import of ", QuoteSession(session_id_), ": page ",
                                                seg.page_index, " checksum mismatch"));
      }
      sp.verified = true;
    }
  }
  return absl::OkStatus();
}

absl::Status SessionImporter::Commit(const KvChunk& c) {
  const int64_t len = static_cast<int64_t>(tokens_.size());
  const std::string who = absl::StrCat("import of ", QuoteSession(session_id_), ": ");
  if (c.num_tokens != len) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, "commit says ", c.num_tokens, " tokens, received ", len));
  }
  const int64_t p = port_->shape().page_tokens;
  const int64_t w = port_->shape().sliding_window;
  const int64_t first_live = (w > 0 && len > w) ? (len - w) / p : 0;
  const int64_t n_pages = (len + p - 1) / p;
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
      port_->CountChecksumFailure();
      return absl::DataLossError(absl::StrCat(who, "page ", i, " checksum differs from commit"));
    }
  }
  // Verified. The port takes every staging page, whether it commits or fails
  // (ALREADY_EXISTS when the id appeared meanwhile).
  ImportedSession session;
  session.session_id = session_id_;
  session.tenant = tenant_;
  session.tokens = std::move(tokens_);
  session.first_live_page = first_live;
  session.staged.reserve(staged_.size());
  for (const Staged& sp : staged_) session.staged.push_back(sp.page);
  staged_.clear();
  tokens_.clear();
  KVCACHE_RETURN_IF_ERROR(port_->CommitImport(std::move(session)));
  committed_ = true;
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
