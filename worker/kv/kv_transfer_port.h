// KvTransferPort: everything session export and import (kv_transfer.h) may ask of a
// KvCacheManager, and nothing more. The manager stays the one owner of a session's
// lifecycle: exporters and importers never see its tables, its pages or its lock;
// they call these methods, and each method applies one change the manager's way
// (its events, counters and invariants).
//
// Export (pre-copy):
//   OpenExport(id)            once: the session as it is now, and a handle naming it
//   CheckExport(h)            the session is still there (and how long it is)
//   ReadPage(h, i, ...)       bytes and checksum of a live page
//   FreezeExport(h)           final phase: the session stops changing
//   FinishExport(h, pages)    final phase done: unfreeze, emit kSessionExported
//   (or UnfreezeExport(h))    final phase abandoned
// Import:
//   CheckImportId(id)         fail early when the id is taken
//   AllocateStaging()         a page no session can see: tier 0, else tier 1
//   WriteStaging / StagingChecksum
//   CommitImport(session)     the session appears atomically; takes the staging pages
//   (or FreeStaging(pages))   import abandoned
//
// Thread-safety: every method is thread-safe. Each one that touches the manager's
// state takes the manager's mutex for its own duration only; no lock is held between
// calls, so what one call saw may have changed by the next, except that a frozen
// session's tokens, page contents and extent do not change (its pages may still move
// between tiers). REQUIRES: the manager outlives the port's users.
#ifndef KVCACHE_WORKER_KV_KV_TRANSFER_PORT_H_
#define KVCACHE_WORKER_KV_KV_TRANSFER_PORT_H_

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "worker/kv/kv_shape.h"
#include "worker/kv/tier_storage.h"

namespace kvcache::kv {

// Names one incarnation of a session: once the id is closed and created (or
// imported) again, the handle no longer matches.
struct ExportHandle {
  std::string session_id;
  uint64_t uid = 0;  // opaque; unique over the manager's life
};

// Which pages of a session are live: [first_live_page, ceil(num_tokens / page_tokens)).
struct ExportExtent {
  int64_t num_tokens = 0;       // committed tokens
  int64_t first_live_page = 0;  // pages before it were released by the sliding window
};

// A session as one call saw it, under the manager's lock.
struct ExportView {
  ExportHandle handle;
  std::string tenant;
  std::vector<int32_t> tokens;  // committed tokens (excluding a step's reserved slots)
  int64_t first_live_page = 0;
  // Per page-table entry (reserved pages of a step included): the manager's write
  // epoch at the page's last write. A page with epoch > E was written after a view
  // whose write_epoch was E.
  std::vector<uint64_t> page_epoch;
  uint64_t write_epoch = 0;  // the manager's write epoch when the view was taken
};

// A staging page and its tier: 0 when the pressure policy could make room there,
// else 1 (the imported session then starts with that page offloaded).
struct StagingPage {
  int tier = 0;
  PageId id = kNoPage;
};

// What an importer hands over to create a session.
struct ImportedSession {
  std::string session_id;
  std::string tenant;
  std::vector<int32_t> tokens;
  int64_t first_live_page = 0;  // must be what the sliding window implies for tokens
  // Staging pages by page index, id kNoPage where none. The entries in
  // [first_live_page, ceil(tokens / page_tokens)) become the session's pages, in the
  // tier they were staged in; any other staging page listed is freed.
  std::vector<StagingPage> staged;
};

// ReadPage's `max_epoch` that reads a page whenever it is written.
inline constexpr uint64_t kAnyEpoch = std::numeric_limits<uint64_t>::max();

class KvTransferPort {
 public:
  virtual ~KvTransferPort() = default;

  // The manager's configuration (immutable; no lock).
  virtual const KvShape& shape() const = 0;
  virtual const std::string& model_id() const = 0;
  virtual int64_t max_session_tokens() const = 0;

  // --- Export -------------------------------------------------------------------
  // The session's state now and a handle naming it.
  // NOT_FOUND for an unknown id, FAILED_PRECONDITION for a closed one.
  virtual absl::StatusOr<ExportView> OpenExport(const std::string& session_id) = 0;
  // The extent of the handle's session now. FAILED_PRECONDITION ("export of 'id': the
  // session was closed meanwhile") once it was closed or its id reused; every method
  // below taking a handle answers the same.
  virtual absl::StatusOr<ExportExtent> CheckExport(const ExportHandle& h) = 0;
  // Copies bytes [offset, offset + out.size()) of page `index` into `out` from
  // whichever tier holds it and, when `sum` is non-null, sets it to the whole page's
  // checksum; both under one hold of the lock, so they describe the same bytes.
  // Returns false, reading nothing, when the page is not live: outside the page
  // table, released by the sliding window, or written after epoch `max_epoch`.
  // INVALID_ARGUMENT when the range leaves the page; storage errors as they come.
  virtual absl::StatusOr<bool> ReadPage(const ExportHandle& h, int64_t index, uint64_t max_epoch,
                                        int64_t offset, absl::Span<uint8_t> out, PageChecksum* sum) = 0;
  // Freezes the session for the final phase and returns its state: until
  // FinishExport or UnfreezeExport it takes no step and cannot be truncated, closed
  // or given a prefix, and the pressure policy leaves it alone. FAILED_PRECONDITION
  // while a step is in progress ("final phase must run between steps").
  virtual absl::StatusOr<ExportView> FreezeExport(const ExportHandle& h) = 0;
  // Unfreezes the session and emits kSessionExported naming `exported_pages`.
  virtual absl::Status FinishExport(const ExportHandle& h, int64_t exported_pages) = 0;
  // Unfreezes the session if it still exists; no event. Always succeeds.
  virtual void UnfreezeExport(const ExportHandle& h) = 0;

  // --- Import -------------------------------------------------------------------
  // ALREADY_EXISTS ("'id' already exists") when a session has this id now. A check
  // only: CommitImport checks again.
  virtual absl::Status CheckImportId(const std::string& session_id) = 0;
  // Takes a page for staging (counted in its tier's TierStats::in_flight_pages): in
  // tier 0, running the pressure policy without preemption when none is free there;
  // when that finds no room (tier 0 held by running, pinned or frozen sessions), in
  // tier 1, dropping offloaded sessions' tier-1 pages as an offload would. So a
  // migration onto a busy worker lands offloaded instead of failing. The caller owns
  // the page until it passes it to CommitImport or FreeStaging. RESOURCE_EXHAUSTED
  // when neither tier has a page to give.
  virtual absl::StatusOr<StagingPage> AllocateStaging() = 0;
  // Copies `bytes` into staging page `page` at byte `offset`.
  // INVALID_ARGUMENT when `page` is not a staging page or the range leaves it.
  virtual absl::Status WriteStaging(StagingPage page, int64_t offset, absl::Span<const uint8_t> bytes) = 0;
  // Checksum of the whole staging page. INVALID_ARGUMENT when it is not one.
  virtual absl::StatusOr<PageChecksum> StagingChecksum(StagingPage page) = 0;
  // Counts a page rejected by its checksum (KvStats::checksum_failures).
  virtual void CountChecksumFailure() = 0;
  // Returns staging pages to their tier's free list; pages that are not staging
  // pages (kNoPage among them) are skipped.
  virtual void FreeStaging(absl::Span<const StagingPage> pages) = 0;
  // Creates the session from verified staging pages in one step: it appears with
  // all its pages, each in the tier it was staged in, a kSessionPlaced event
  // (kSessionOffloaded after it when some pages are in tier 1), then its full pages
  // in the prefix index of their tier (kPrefixStored). Takes every listed staging
  // page whatever the outcome: on error they are freed and nothing else changed.
  // ALREADY_EXISTS when the id is in use (it may have appeared since CheckImportId);
  // INVALID_ARGUMENT for an empty id or tenant, more than max_session_tokens tokens,
  // a first_live_page the sliding window does not imply, or a live page missing,
  // repeated or not a staging page; RESOURCE_EXHAUSTED when some pages are in tier
  // 1 and the session has more live pages than pinned sessions leave of tier 0 (it
  // could never be restored here).
  virtual absl::Status CommitImport(ImportedSession session) = 0;
};

}  // namespace kvcache::kv

#endif  // KVCACHE_WORKER_KV_KV_TRANSFER_PORT_H_
