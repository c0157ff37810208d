// KvCacheManager: the scheduler-facing KV cache. Sessions own page tables over a
// two-tier page pool; full pages are shared through a tenant-scoped prefix cache;
// memory pressure is resolved by the policy of ARCHITECTURE.md ("The KV cache"):
//
// The prefix index covers both tiers: a full page offloaded to tier 1 stays findable
// by its hash, and a prefix hit there is copied back into tier 0 (a restore, checksum
// verified), never recomputed. Tier-1 pages stay private to their session.
//
//   1. take a free tier-0 page
//   2. evict an unreferenced cached prefix page, least recently released first
//   3. offload an idle session (not running, not pinned) to tier 1, least recently used
//      first; tier-1 room is made by
//   4. dropping tier-1 pages of the least recently used offloaded session (idle ones
//      before those with a request running), from its tail: that session is truncated
//      to its longest still-complete prefix (to empty when a sliding window already
//      released pages that prefix would need). When tier 1 cannot take the victim's
//      pages at all, the victim's own tail is dropped.
//   5. preempt a running session that is not in a step: offload it like (3) (its tail
//      dropped when tier 1 has no room) and name it in StepReservation::preempted.
//
// Losing cached pages costs recompute, never correctness: a session's token list and
// its pages always agree, and BeginStep's first_pos is the length the cache holds.
// The scheduler, which holds every session's tokens, checks first_pos against the
// length it expects on every step and recomputes what was dropped before going on.
//
// Per engine step (plan, then apply):
//   AttachPrefix(id, prompt)     on a new session, and again at page boundaries of its
//                                prefill: reuse cached pages (either tier)
//   BeginStep(id, n)             pin + restore + allocate slots for n tokens; returns
//                                the page table; all-or-nothing
//   ... engine writes K/V for positions [first_pos, first_pos + n) through
//       Tier0PageData(page) + KOffset/VOffset (kv_shape.h) and reads earlier ones ...
//   CommitStep(id, tokens)       append the token ids, publish newly full pages, unpin
//   (or AbortStep(id))
// A step-pinned session's pages are never moved, evicted or copied over, so the
// pointers stay valid until CommitStep/AbortStep.
//
// Statuses: NOT_FOUND unknown session; FAILED_PRECONDITION wrong state (closed
// session, step in progress, pinned); INVALID_ARGUMENT bad arguments or limits;
// RESOURCE_EXHAUSTED no room after the policy ran; DATA_LOSS checksum mismatch;
// ALREADY_EXISTS duplicate session id. Messages name the session.
//
// Export and import (kv_transfer.h) reach sessions only through transfer_port(), a
// KvTransferPort whose every call is one locked operation of this manager. An
// import stages its pages in tier 0, or in tier 1 when steps 1-4 find no tier-0
// room (it never preempts): the session then arrives offloaded.
//
// Thread-safety: all public methods are thread-safe (one internal mutex). Page bytes
// handed out by BeginStep may be written without the lock by the step's owner only.
#ifndef KVCACHE_WORKER_KV_KV_CACHE_MANAGER_H_
#define KVCACHE_WORKER_KV_KV_CACHE_MANAGER_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "common/block_hash.h"
#include "worker/kv/kv_events.h"
#include "worker/kv/kv_shape.h"
#include "worker/kv/kv_stats.h"
#include "worker/kv/kv_transfer_port.h"
#include "worker/kv/page_pool.h"
#include "worker/kv/tier_storage.h"

namespace kvcache::kv {

struct KvCacheOptions {
  KvShape shape;
  std::string model_id;     // part of every prefix hash
  int64_t tier0_bytes = 0;  // budget; capacity = tier0_bytes / page_bytes (>= 1 page)
  int64_t tier1_bytes = 0;  // budget; 0 disables offload (idle sessions are dropped)
  int64_t max_session_tokens = 1 << 20;
  size_t event_capacity = 1 << 16;
  size_t closed_ids_remembered = 4096;  // to answer FAILED_PRECONDITION for closed ids
  TierStorageFactory storage_factory;   // default: CreateCpuTierStorage for both tiers
};

// What the scheduler needs for one step of one session.
struct StepReservation {
  int64_t first_pos = 0;  // position of the first new token (tokens committed so far)
  int64_t num_new_tokens = 0;
  // Tier-0 page ids; page i holds positions [i*page_tokens, (i+1)*page_tokens).
  // kNoPage for pages the sliding window released.
  std::vector<PageId> page_table;
  int64_t restored_pages = 0;          // pages brought back from tier 1 for this step
  std::vector<std::string> preempted;  // running sessions preempted to make room (informational)
};

struct SessionInfo {
  std::string id;
  std::string tenant;
  int64_t num_tokens = 0;
  int64_t reserved_tokens = 0;  // handed out by BeginStep, not yet committed
  int64_t first_live_page = 0;  // pages before it were released by the sliding window
  int64_t tier0_pages = 0;
  int64_t tier1_pages = 0;
  int64_t shared_pages = 0;  // tier-0 pages other sessions reference too (forks, prefix hits)
  bool in_step = false;
  bool user_pinned = false;
  bool running = false;
  uint64_t last_use = 0;            // logical clock
  std::vector<int32_t> page_tiers;  // per page: 0, 1, or -1 (released)
  std::vector<PageId> page_ids;     // per page: id within its tier, or kNoPage
};

struct KvSnapshot {
  uint64_t last_seq = 0;                      // events up to this seq are reflected
  std::vector<SessionInfo> sessions;          // page lists omitted
  std::vector<BlockHash> prefix_hashes;       // every hash in the tier-0 prefix cache
  std::vector<BlockHash> host_prefix_hashes;  // every hash the tier-1 index holds
};

class KvCacheManager {
 public:
  // Validates the options and allocates both tiers.
  // INVALID_ARGUMENT for a bad shape or a tier-0 budget under one page.
  static absl::StatusOr<std::unique_ptr<KvCacheManager>> Create(KvCacheOptions options);
  ~KvCacheManager();
  KvCacheManager(const KvCacheManager&) = delete;
  KvCacheManager& operator=(const KvCacheManager&) = delete;

  const KvShape& shape() const { return options_.shape; }
  const std::string& model_id() const { return options_.model_id; }
  int64_t tier_capacity_pages(int tier) const;

  // --- Sessions ---------------------------------------------------------------
  // REQUIRES: id and tenant non-empty; id not in use (else ALREADY_EXISTS).
  absl::Status CreateSession(const std::string& id, const std::string& tenant);
  // Releases every page; `pages_freed` (optional) gets the pages whose last
  // reference this was (shared pages still referenced elsewhere are not counted).
  // FAILED_PRECONDITION while a step or export holds the session. A non-empty
  // `moved_to` (the worker that holds the session now, after a migration) is
  // announced with kSessionMigrated instead of kSessionClosed.
  absl::Status CloseSession(const std::string& id, int64_t* pages_freed = nullptr,
                            const std::string& moved_to = "");
  // Extends the session with the cached pages (whole pages, same tenant and model,
  // either tier) that continue it along `prompt`, and returns the tokens attached by
  // this call (a multiple of page_tokens). Pages found only in tier 1 are copied into
  // tier 0 (counted in `restored_tokens` when given, and as restores); a checksum
  // mismatch there ends the attach early, never fails it. On an empty session this is
  // the prefix-cache lookup of a new request (a session's first call counts
  // prompt.size() queried); a prefill calls it again at page boundaries to pick up
  // pages another request has computed since. Pass prompt minus its last token when
  // the engine must still compute logits for it.
  // FAILED_PRECONDITION during a step or export, when the session's length is not a
  // multiple of page_tokens, or when its tokens are not a prefix of `prompt`.
  absl::StatusOr<int64_t> AttachPrefix(const std::string& id, absl::Span<const int32_t> prompt,
                                       int64_t* restored_tokens = nullptr);
  // Longest cached prefix in tokens (either tier), without attaching or counting (for
  // routing).
  int64_t LookupPrefix(const std::string& tenant, absl::Span<const int32_t> tokens) const;

  // Reserves slots for `n` new tokens: step-pins the session, restores it from tier 1,
  // copies a shared tail page (copy-on-write), allocates pages, running the pressure
  // policy when needed (only BeginStep may preempt). On error the step is not begun
  // and the session's tokens are unchanged (it may have been restored to tier 0;
  // after DATA_LOSS on restore its cache was dropped to 0 tokens).
  // REQUIRES: n >= 0, num_tokens + n <= max_session_tokens (INVALID_ARGUMENT).
  absl::StatusOr<StepReservation> BeginStep(const std::string& id, int64_t n);
  // Appends `tokens` (at most the reserved count; unused reserved pages are released),
  // registers newly full pages in the prefix cache, applies the sliding window and
  // ends the step.
  absl::Status CommitStep(const std::string& id, absl::Span<const int32_t> tokens);
  // Ends the step without appending.
  absl::Status AbortStep(const std::string& id);
  // BeginStep + CommitStep without writing K/V (pages keep what they held).
  absl::Status AppendTokens(const std::string& id, absl::Span<const int32_t> tokens);

  // Cuts the session to its first `num_tokens` tokens.
  // FAILED_PRECONDITION when the sliding window already released pages the shorter
  // session would need, or during a step.
  absl::Status Truncate(const std::string& id, int64_t num_tokens);
  // New session `dst_id` (same tenant) sharing all full pages of `src_id`; only the
  // partial tail page is copied. Restores `src_id` first if it was offloaded.
  absl::Status Fork(const std::string& src_id, const std::string& dst_id);

  // Moves every tier-0 page of the session to tier 1 (dropping other sessions' tier-1
  // pages LRU when needed). FAILED_PRECONDITION when pinned or in a step;
  // RESOURCE_EXHAUSTED (nothing changed) when tier 1 is too small for it.
  absl::Status Offload(const std::string& id);
  // Brings the session's tier-1 pages back to tier 0, verifying checksums. DATA_LOSS
  // when a page is corrupt: the session's cache is then dropped (0 tokens), cleanly.
  absl::Status Restore(const std::string& id);
  // User pin: restores the session and keeps it in tier 0 until unpinned.
  absl::Status PinSession(const std::string& id);
  // Tier-0 pages a restore could have now without preempting a request: free,
  // cached unreferenced, and the pages of idle, unpinned sessions that no pinned
  // or running session holds too (a pinned import's pre-commit check,
  // Engine::CheckImportPin).
  int64_t Tier0PagesFreeable() const;
  absl::Status UnpinSession(const std::string& id);
  // The request on this session finished: its pages become offload candidates
  // (policy step 3) instead of preemption candidates (step 5).
  absl::Status MarkIdle(const std::string& id);

  absl::StatusOr<SessionInfo> GetSession(const std::string& id) const;
  absl::StatusOr<std::vector<int32_t>> GetTokens(const std::string& id) const;
  // Tokens the session holds (GetSession's num_tokens, without the page lists).
  absl::StatusOr<int64_t> NumTokens(const std::string& id) const;

  // --- Page bytes ---------------------------------------------------------------
  // Host pointer of a tier-0 page (nullptr for device tiers or a bad id). Valid while
  // the session using it is in a step.
  uint8_t* Tier0PageData(PageId id);
  // The tier storages, for backends and tests.
  TierStorage& tier_storage(int tier);

  // --- Observability ------------------------------------------------------------
  KvStats GetStats() const;
  EventBatch ReadEvents(uint64_t after_seq, size_t max_events = 1024) const;
  KvSnapshot Snapshot() const;
  // Verifies every structural invariant (refcounts equal referrers, each page in
  // exactly one state of exactly one tier, budgets, page tables match token counts,
  // prefix index matches cached pages). INTERNAL naming the first violation.
  absl::Status CheckInvariants() const;

  // --- Transfer -------------------------------------------------------------------
  // The narrow interface through which SessionExporter and SessionImporter
  // (kv_transfer.h) read, freeze and create sessions (kv_transfer_port.h). Lives as
  // long as the manager.
  KvTransferPort& transfer_port() { return transfer_port_; }

 private:
  struct PageLoc {
    int8_t tier = -1;  // -1: released by the sliding window
    PageId id = kNoPage;
  };
  struct Session {
    uint64_t uid = 0;  // unique over the manager's life (an id may be reused)
    std::string id;
    std::string tenant;
    std::vector<int32_t> tokens;
    std::vector<PageLoc> pages;        // ceil((tokens + reserved) / page_tokens)
    std::vector<uint64_t> page_epoch;  // write epoch of each page (pre-copy export)
    std::vector<BlockHash> hashes;     // chained hash of each full committed page
    int64_t first_live = 0;
    int64_t reserved = 0;
    int64_t tier1_pages = 0;
    bool in_step = false;        // step pin
    bool export_frozen = false;  // final export phase running
    bool restoring = false;      // making room for its own restore
    bool user_pinned = false;
    bool running = false;
    bool prefix_queried = false;  // AttachPrefix counted its query
    uint64_t last_use = 0;
  };

  // KvTransferPort on this manager's state (kv_transfer_port.cc). Each method takes
  // mu_ for its own duration.
  class TransferPort final : public KvTransferPort {
   public:
    explicit TransferPort(KvCacheManager* m) : m_(m) {}

    const KvShape& shape() const override;
    const std::string& model_id() const override;
    int64_t max_session_tokens() const override;

    absl::StatusOr<ExportView> OpenExport(const std::string& session_id) override
        ABSL_LOCKS_EXCLUDED(m_->mu_);
    absl::StatusOr<ExportExtent> CheckExport(const ExportHandle& h) override ABSL_LOCKS_EXCLUDED(m_->mu_);
    absl::StatusOr<bool> ReadPage(const ExportHandle& h, int64_t index, uint64_t max_epoch, int64_t offset,
                                  absl::Span<uint8_t> out, PageChecksum* sum) override
        ABSL_LOCKS_EXCLUDED(m_->mu_);
    absl::StatusOr<ExportView> FreezeExport(const ExportHandle& h) override ABSL_LOCKS_EXCLUDED(m_->mu_);
    absl::Status FinishExport(const ExportHandle& h, int64_t exported_pages) override
        ABSL_LOCKS_EXCLUDED(m_->mu_);
    void UnfreezeExport(const ExportHandle& h) override ABSL_LOCKS_EXCLUDED(m_->mu_);

    absl::Status CheckImportId(const std::string& session_id) override ABSL_LOCKS_EXCLUDED(m_->mu_);
    absl::StatusOr<StagingPage> AllocateStaging() override ABSL_LOCKS_EXCLUDED(m_->mu_);
    absl::Status WriteStaging(StagingPage page, int64_t offset, absl::Span<const uint8_t> bytes) override
        ABSL_LOCKS_EXCLUDED(m_->mu_);
    absl::StatusOr<PageChecksum> StagingChecksum(StagingPage page) override ABSL_LOCKS_EXCLUDED(m_->mu_);
    void CountChecksumFailure() override ABSL_LOCKS_EXCLUDED(m_->mu_);
    void FreeStaging(absl::Span<const StagingPage> pages) override ABSL_LOCKS_EXCLUDED(m_->mu_);
    absl::Status CommitImport(ImportedSession session) override ABSL_LOCKS_EXCLUDED(m_->mu_);

   private:
    // The handle's session, or FAILED_PRECONDITION when it was closed or replaced.
    absl::StatusOr<Session*> Lookup(const ExportHandle& h) ABSL_EXCLUSIVE_LOCKS_REQUIRED(m_->mu_);
    ExportView ViewOf(const Session& s) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(m_->mu_);
    bool IsStaging(StagingPage page) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(m_->mu_);
    void FreeStagingLocked(absl::Span<const StagingPage> pages) ABSL_EXCLUSIVE_LOCKS_REQUIRED(m_->mu_);

    KvCacheManager* const m_;
  };

  KvCacheManager(KvCacheOptions options, TierStoragePtr tier0, TierStoragePtr tier1);

  int64_t P() const { return options_.shape.page_tokens; }
  int64_t PagesFor(int64_t tokens) const { return (tokens + P() - 1) / P(); }
  absl::StatusOr<Session*> Find(const std::string& id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<const Session*> Find(const std::string& id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Touch(Session& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { s.last_use = ++clock_; }
  bool Pinned(const Session& s) const { return s.in_step || s.user_pinned || s.export_frozen || s.restoring; }
  void Emit(KvEventType type, const Session* s, int64_t pages, std::vector<BlockHash> hashes = {},
            std::string target = "") ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Frees a page-table entry (decref tier 0, free tier 1) and marks it released.
  void ReleaseLoc(Session& s, int64_t index) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The tier-1 half of the prefix index. IndexHostPageLocked records that tier-1
  // `page` holds `h` (unless another page does already) and appends `h` to `stored`;
  // FreeTier1PageLocked frees a tier-1 page, unindexing it (announced by the next
  // FlushHostRemovedLocked, which every operation that frees tier-1 pages calls).
  // UnindexHostPageLocked only unindexes (announced the same way).
  void IndexHostPageLocked(PageId page, const BlockHash& h, std::vector<BlockHash>* stored)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void UnindexHostPageLocked(PageId page) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FreeTier1PageLocked(PageId page) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FlushHostRemovedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Registers tier-0 `page` (full, holding `h`) in the prefix index unless `h` is
  // there already; appends `h` to `stored` when it was added.
  void IndexDevicePageLocked(PageId page, const BlockHash& h, std::vector<BlockHash>* stored)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes cached tier-0 `page` out of the prefix index (announced at once).
  void UnindexDevicePageLocked(PageId page) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Emits kPrefixStored/kPrefixRemoved for `hashes` in `tier` (nothing when empty).
  void EmitPrefixLocked(KvEventType type, int tier, std::vector<BlockHash> hashes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Copies the tier-1 page indexed under `h` into a new tier-0 page for AttachPrefix
  // of `s`. Returns kNoPage when tier 0 has no room, the page went while room was
  // made, or the copy fails its checksum (the page is then unindexed).
  PageId CopyHostPageLocked(const BlockHash& h, const Session& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Cuts pages and tokens to `len` (no window check). Returns the new length, which is
  // 0 when the sliding window makes a shorter cut invalid.
  int64_t CutLocked(Session& s, int64_t len) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool CutValid(const Session& s, int64_t len) const;
  void ApplyWindow(Session& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Hashes full committed pages not hashed yet and registers each in the prefix
  // index of its tier.
  void PublishFullPages(Session& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CloseLocked(Session& s, const std::string& moved_to = "") ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // GetSession's fields without the per-page lists (what Snapshot reports).
  SessionInfo SummaryLocked(const Session& s) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // The pressure policy: makes `n` tier-0 pages free, never touching `protect` or a
  // pinned session. Appends preempted sessions' ids.
  // Step 5 (preemption) runs only when `preempted` is non-null.
  absl::Status MakeRoom(int64_t n, const Session* protect, std::vector<std::string>* preempted)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether moving `s` out of tier 0 would free a page there (one it alone holds).
  bool FreesTier0Page(const Session& s) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether MakeRoom leaves `s` in tier 0 unless it preempts.
  bool StaysInTier0(const Session& s) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return Pinned(s) || s.running;
  }
  // The distinct tier-0 pages of sessions that StaysInTier0 (TierStats::held_pages).
  absl::flat_hash_set<PageId> HeldTier0PagesLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Frees tier-1 pages, LRU session first, until `n` are free or nothing is droppable.
  void DropTier1(int64_t n, const Session* protect) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Moves the session's tier-0 pages to tier 1; with `allow_drop`, pages tier 1 cannot
  // take are dropped (the session is cut before the first one). Returns pages moved.
  absl::StatusOr<int64_t> OffloadLocked(Session& s, bool allow_drop) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status RestoreLocked(Session& s, std::vector<std::string>* preempted)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<PageChecksum> PageChecksumLocked(const Session& s, int64_t index) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const KvCacheOptions options_;
  TierStorage* const storage_[2];  // owned by pool_; the pointers never change
  mutable absl::Mutex mu_;
  PagePool pool_[2] ABSL_GUARDED_BY(mu_);
  std::vector<PageChecksum> tier1_checksum_ ABSL_GUARDED_BY(mu_);
  // Prefix cache: hash -> tier-0 page, and the reverse for cached pages.
  absl::flat_hash_map<BlockHash, PageId> prefix_index_ ABSL_GUARDED_BY(mu_);
  std::vector<BlockHash> page_hash_ ABSL_GUARDED_BY(mu_);
  // Its tier-1 half: hash -> one tier-1 page holding it (sessions' offloaded copies),
  // and the reverse per tier-1 page (host_indexed_ says whether the entry is live).
  absl::flat_hash_map<BlockHash, PageId> host_index_ ABSL_GUARDED_BY(mu_);
  std::vector<BlockHash> host_page_hash_ ABSL_GUARDED_BY(mu_);
  std::vector<uint8_t> host_indexed_ ABSL_GUARDED_BY(mu_);
  std::vector<BlockHash> host_removed_ ABSL_GUARDED_BY(mu_);  // unindexed, not yet announced
  absl::flat_hash_map<std::string, std::unique_ptr<Session>> sessions_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<std::string> closed_ids_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> closed_order_ ABSL_GUARDED_BY(mu_);
  int64_t staging_pages_[2] ABSL_GUARDED_BY(mu_) = {0, 0};  // per tier
  uint64_t clock_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t write_epoch_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_uid_ ABSL_GUARDED_BY(mu_) = 1;
  KvStats counters_ ABSL_GUARDED_BY(mu_);  // event counters; page counts filled by GetStats
  EventLog events_ ABSL_GUARDED_BY(mu_);
  TransferPort transfer_port_{this};
};

}  // namespace kvcache::kv

#endif  // KVCACHE_WORKER_KV_KV_CACHE_MANAGER_H_
