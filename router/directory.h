// The router's view of the fleet's caches, built only from the workers' Watch
// streams: which worker holds each session (and in which tier), which workers
// hold each prefix page hash (and in which tier), and each worker's load.
//
// Sessions are keyed by (tenant, session id), as the workers key them: the same
// id in two tenants names two independent sessions, and a lookup answers only
// about the caller's own tenant (another tenant's session by that id is as
// absent as one that never existed).
//
// Every router replica fed the same streams builds the same directory: the
// worker is the authority on what it holds, and the directory never guesses.
// A snapshot replaces everything previously known about that worker, so a
// router that missed events (a sequence gap) resyncs by asking for a new one
// (WatchIngest, watch_ingest.h, detects the gap).
//
// Memory, sized for fleets (tests/bench/router_scale_bench.cc measures it):
// workers are interned to dense indices; a page is keyed by the first 64 bits
// of its SHA-256 chain hash (uniformly distributed; two distinct pages among
// 10^8 cached ones share a key with probability ~3e-4, and a shared key costs
// only a wrong reuse estimate in placement, never correctness: the worker
// checks the full hash); its holders are packed 32-bit (worker, tier bits)
// values, one inline, more on the heap; each worker keeps the set of its page
// keys so that a snapshot or a removal costs that worker's pages, not the
// fleet's.
//
// Thread-safety: all methods take an internal lock; safe from any thread.
#ifndef KVCACHE_ROUTER_DIRECTORY_H_
#define KVCACHE_ROUTER_DIRECTORY_H_

#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/block_hash.h"
#include "kvcache/v1/worker.pb.h"

namespace kvcache::router {

using WorkerId = std::string;

// A session's name: its tenant and its id within the tenant.
struct SessionKey {
  std::string tenant;
  std::string session_id;

  friend bool operator==(const SessionKey& a, const SessionKey& b) {
    return a.tenant == b.tenant && a.session_id == b.session_id;
  }
  template <typename H>
  friend H AbslHashValue(H h, const SessionKey& k) {
    return H::combine(std::move(h), k.tenant, k.session_id);
  }
};

// Where a session lives according to its worker.
struct SessionLocation {
  std::string session_id;
  WorkerId worker;
  v1::Tier tier = v1::TIER_DEVICE;
  int32_t tokens = 0;
  std::string tenant;

  SessionKey key() const { return SessionKey{tenant, session_id}; }
};

// How many leading pages of a hash chain one worker holds.
struct PrefixMatch {
  int device_pages = 0;  // leading pages in Tier 0
  int host_pages = 0;    // further leading pages found only in Tier 1
  int total_pages() const { return device_pages + host_pages; }
};

class Directory {
 public:
  Directory();
  ~Directory();
  Directory(const Directory&) = delete;
  Directory& operator=(const Directory&) = delete;

  // Replaces everything known about `worker` with `snapshot`, except that a
  // stale copy (MarkStale) it lists is not taken while another worker holds
  // the session: it is queued for TakeStaleCopies instead.
  void ApplySnapshot(const WorkerId& worker, const v1::WorkerSnapshot& snapshot);
  // Applies one cache event from `worker`'s stream.
  void ApplyEvent(const WorkerId& worker, const v1::CacheEvent& event);
  void ApplyLoad(const WorkerId& worker, const v1::WorkerLoad& load);
  // Forgets a worker (it went down or left the fleet): its sessions and pages
  // are no longer anywhere. Returns the sessions that were lost with it.
  // `may_return`: the worker is unreachable, not gone, and may come back with
  // its sessions (a hung process, a partition): each becomes a stale copy
  // (MarkStale), which counts only if no other worker holds the session by
  // then. Otherwise (it left the membership) nothing of it is kept.
  std::vector<SessionKey> RemoveWorker(const WorkerId& worker, bool may_return = false);

  // Stale copies: `worker`'s copy of the session is older than the session
  // (a FULL_CONTEXT turn moved the session elsewhere while that worker could
  // not be told to close its copy, or the worker was forgotten while it held
  // the session). Until the copy is gone, no claim of it from a snapshot or a
  // tier move wins over another worker's claim, so that calls never reach a
  // conversation that has moved on; a snapshot of `worker` that lists it while
  // another worker holds the session queues it for closing (TakeStaleCopies).
  // A new placement on `worker`, its drop or export, a snapshot that no longer
  // lists it, or ClearStale (the close was answered, or a FULL_CONTEXT turn was
  // sent to that worker, which makes its copy current) ends the mark.
  void MarkStale(const SessionKey& key, const WorkerId& worker);
  void ClearStale(const SessionKey& key, const WorkerId& worker);
  // Stale copies that their workers listed again, for the caller to close;
  // each is returned once per snapshot that listed it.
  std::vector<std::pair<SessionKey, WorkerId>> TakeStaleCopies();
  // Marks held: for tests and metrics.
  size_t stale_copies() const;
  // Sessions lost with their worker (each time one was, for LostWith) over this
  // directory's life: for metrics.
  uint64_t sessions_lost() const;

  std::optional<SessionLocation> FindSession(const SessionKey& key) const;
  // A request on the session finished on `worker` with `tokens` in its context
  // (cache events carry a session's length when it is placed, not as it grows).
  void NoteSessionTokens(const SessionKey& key, const WorkerId& worker, int32_t tokens);
  // FindSession, waiting up to `timeout` for the session to appear (a worker's
  // placement event may trail the reply that created the session).
  std::optional<SessionLocation> AwaitSession(const SessionKey& key, absl::Duration timeout) const;
  // Waits up to `timeout` for the session to be on a worker other than `worker`
  // (moved by a migration). Returns where it is then (nullopt: nowhere).
  std::optional<SessionLocation> AwaitSessionOff(const SessionKey& key, const WorkerId& worker,
                                                 absl::Duration timeout) const;
  // AwaitSession as callers see it: NOT_FOUND "session 'ID' not found" when
  // the tenant holds no session by that id, whether or not another tenant does
  // (the same code, message and wait either way), or LostError when it was
  // lost with its worker. Blocks up to `timeout`.
  absl::StatusOr<SessionLocation> Lookup(const SessionKey& key, absl::Duration timeout) const;
  // The worker a session was lost with: the one that held it when that worker
  // was forgotten (unreachable past --forget_after, or gone from the fleet) or
  // came back without it (a restarted process at the same address), while no
  // worker has listed the session since. The last kMaxLost such sessions are
  // remembered.
  std::optional<WorkerId> LostWith(const SessionKey& key) const;
  // UNAVAILABLE naming the session and the worker it was lost with, and what the
  // client can do (router.proto: an APPEND whose worker is lost).
  static absl::Status LostError(const SessionKey& key, const WorkerId& worker);
  static constexpr size_t kMaxLost = 1 << 16;
  // Every tenant's session with this id: for operators (admin calls name a
  // session by id alone), never for a tenant's own calls.
  std::vector<SessionLocation> SessionsNamed(const std::string& session_id) const;
  // For each worker holding at least the first page: how many leading pages of
  // `chain` it holds, tier-aware (a page counts in the deepest tier that has it
  // on that worker: device if present there, else host).
  absl::flat_hash_map<WorkerId, PrefixMatch> MatchPrefix(absl::Span<const BlockHash> chain) const;
  std::optional<v1::WorkerLoad> Load(const WorkerId& worker) const;
  // The model id and page geometry the worker reported in its last snapshot.
  std::optional<v1::WorkerSnapshot> Describe(const WorkerId& worker) const;
  std::vector<SessionLocation> SessionsOn(const WorkerId& worker) const;
  // How many sessions each known worker holds.
  absl::flat_hash_map<WorkerId, int64_t> SessionCounts() const;
  // Number of (hash, worker) entries: for tests and metrics.
  size_t prefix_entries() const;
  size_t session_count() const;
  // Number of distinct page keys (a page cached on three workers counts once).
  size_t distinct_pages() const;

  // A digest of what the directory holds: every session (tenant, id, worker,
  // tier) and every (page, worker, tiers) entry, independent of the order they
  // were learnt in and of the router's internal worker indices. Two replicas
  // agree when their digests are equal. Left out: load reports (they change
  // every report interval) and session lengths (they grow without cache
  // events, and each router learns them from its own requests' replies).
  uint64_t Digest() const;

  // Bytes the directory's tables hold, from their capacities (slots, control
  // bytes, heap holder arrays, out-of-line strings): what it costs to know
  // about pages, and about sessions. Excludes allocator overhead.
  struct MemoryUsage {
    size_t page_bytes = 0;     // page -> holders table, heap holders, per-worker page-key sets
    size_t session_bytes = 0;  // session table (keys and their strings)
  };
  MemoryUsage Memory() const;

 private:
  using WorkerIndex = uint32_t;
  // A page's key: the first 64 bits of its chain hash (see the header comment).
  using PageKey = uint64_t;
  static PageKey KeyOf(const BlockHash& h);

  // The workers holding one page: packed (worker index << 2 | tier bits),
  // sorted by worker index; one inline (the common case), more on the heap.
  class Holders {
   public:
    Holders() = default;
    Holders(Holders&& o) noexcept;
    Holders& operator=(Holders&& o) noexcept;
    Holders(const Holders&) = delete;
    Holders& operator=(const Holders&) = delete;
    ~Holders();

    uint32_t size() const { return size_; }
    bool empty() const { return size_ == 0; }
    const uint32_t* data() const { return size_ <= 1 ? &one_ : heap_; }
    // Tier bits of `w`, 0 when it does not hold the page.
    uint8_t Find(WorkerIndex w) const;
    // ORs `bits` into w's entry, adding it when absent.
    void Add(WorkerIndex w, uint8_t bits);
    // Clears `bits` from w's entry; drops the entry when none is left.
    // Returns true when w no longer holds the page.
    bool Clear(WorkerIndex w, uint8_t bits);
    size_t heap_bytes() const { return size_ > 1 ? Capacity(size_) * sizeof(uint32_t) : 0; }

   private:
    static uint32_t Capacity(uint32_t n);   // heap slots for n > 1 entries: next power of two
    int64_t Position(WorkerIndex w) const;  // index of w's entry, or -(insertion point) - 1
    uint32_t* heap_ = nullptr;
    uint32_t size_ = 0;
    uint32_t one_ = 0;
  };

  // What a session's entry holds: its location with the worker interned.
  struct SessionEntry {
    WorkerIndex worker = 0;
    int32_t tokens = 0;
    v1::Tier tier = v1::TIER_DEVICE;
  };

  struct WorkerState {
    WorkerId name;
    bool live = false;        // false: a free index
    v1::WorkerSnapshot info;  // sessions/hashes cleared: kept for model id and shape
    v1::WorkerLoad load;
    int64_t sessions = 0;  // entries of sessions_ on this worker
    // Every page key this worker was added to, in order: a superset of what it
    // holds (with keys since removed, and repeats), so that forgetting the
    // worker visits its pages only. Appending is sequential (no lookup per
    // page); CompactLogLocked drops the keys it no longer holds once the log
    // is more than twice what it holds.
    std::vector<PageKey> page_log;
    int64_t page_count = 0;  // (page, this worker) entries in pages_
  };

  // The index of `w`, interning it when new.
  WorkerIndex InternLocked(const WorkerId& w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The index of `w` if known.
  std::optional<WorkerIndex> IndexLocked(const WorkerId& w) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Adds (removes) `tier_bit` of each key for worker `w`, prefetching table
  // slots a few keys ahead: a large directory is bound by cache misses.
  void AddPagesLocked(absl::Span<const PageKey> keys, WorkerIndex w, uint8_t tier_bit)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RemovePagesLocked(absl::Span<const PageKey> keys, WorkerIndex w, uint8_t tier_bit)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CompactLogLocked(WorkerIndex w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops every session and page of `w` and frees its index. `held`, when not
  // null, gets every session it claimed; `lost_sessions` those no other worker
  // claims.
  void ForgetWorkerLocked(const WorkerId& w, std::vector<SessionKey>* lost_sessions,
                          std::vector<SessionKey>* held = nullptr) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether another worker than `w` claims the session (current or older).
  bool ClaimedByAnotherLocked(const SessionKey& key, WorkerIndex w) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  bool IsStaleLocked(const SessionKey& key, const WorkerId& w) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  void ClearStaleLocked(const SessionKey& key, const WorkerId& w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `entry.worker` holds the session now: its claim becomes the current one
  // (sessions_), an earlier claim by another worker waits in older_claims_.
  void ClaimLocked(const SessionKey& key, const SessionEntry& entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Worker `w` no longer holds the session. Returns true when no claim is left.
  bool WithdrawLocked(const SessionKey& key, WorkerIndex w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // w's claim on the session (current or older), or null.
  SessionEntry* ClaimOfLocked(const SessionKey& key, WorkerIndex w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  SessionLocation LocationLocked(const SessionKey& key, const SessionEntry& e) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);

  // Allocates tables of 2 MiB and more on transparent huge pages (where the
  // kernel allows it, madvise mode included): a directory of millions of
  // pages is probed at random, and with 4 KiB pages nearly every probe also
  // misses the TLB. (router_scale_bench at 1,000 workers, with every
  // allocation of the process on huge pages: 1.04M decode events/s per core
  // against 0.75M without.)
  template <typename T>
  struct HugePageAllocator {
    using value_type = T;
    HugePageAllocator() = default;
    template <typename U>
    HugePageAllocator(const HugePageAllocator<U>&) {}  // NOLINT: rebinding, as allocators do
    T* allocate(size_t n);
    void deallocate(T* p, size_t n);
    friend bool operator==(const HugePageAllocator&, const HugePageAllocator&) { return true; }
    friend bool operator!=(const HugePageAllocator&, const HugePageAllocator&) { return false; }
  };
  using PageTable = absl::flat_hash_map<PageKey, Holders, absl::Hash<PageKey>, std::equal_to<PageKey>,
                                        HugePageAllocator<std::pair<const PageKey, Holders>>>;

  mutable absl::Mutex mu_;
  // Each session's current holder: the latest worker to claim it (a placed,
  // offloaded or restored event, or a snapshot listing it) that has not let go.
  absl::flat_hash_map<SessionKey, SessionEntry> sessions_ ABSL_GUARDED_BY(mu_);
  // Earlier claims not yet withdrawn, oldest first: during a migration the
  // target's stream may say "placed" before the source's says "exported", and
  // a session that moves twice may be seen in any interleaving of the two
  // streams. Each stream is in order, so each worker's claim is exact, and once
  // every stream is delivered the current holder is the one worker that holds
  // it, whatever the interleaving: replicas converge. Usually empty.
  absl::flat_hash_map<SessionKey, std::vector<SessionEntry>> older_claims_ ABSL_GUARDED_BY(mu_);
  // Lost sessions (LostWith) and the order they were lost in, for the bound;
  // an entry of lost_order_ whose number lost_ no longer has is skipped.
  struct Lost {
    WorkerId worker;
    uint64_t number = 0;
  };
  absl::flat_hash_map<SessionKey, Lost> lost_ ABSL_GUARDED_BY(mu_);
  std::deque<std::pair<SessionKey, uint64_t>> lost_order_ ABSL_GUARDED_BY(mu_);
  uint64_t lost_count_ ABSL_GUARDED_BY(mu_) = 0;
  void MarkLostLocked(const SessionKey& key, const WorkerId& worker) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Stale copies (MarkStale) by worker name: a forgotten worker has no index.
  absl::flat_hash_map<WorkerId, absl::flat_hash_set<SessionKey>> stale_ ABSL_GUARDED_BY(mu_);
  std::vector<std::pair<SessionKey, WorkerId>> stale_listed_ ABSL_GUARDED_BY(mu_);  // for TakeStaleCopies
  PageTable pages_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<WorkerId, WorkerIndex> index_ ABSL_GUARDED_BY(mu_);
  std::vector<WorkerState> workers_ ABSL_GUARDED_BY(mu_);  // by WorkerIndex
  std::vector<WorkerIndex> free_ ABSL_GUARDED_BY(mu_);     // indices of forgotten workers, for reuse
  size_t prefix_entries_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<PageKey> scratch_keys_ ABSL_GUARDED_BY(mu_);  // an event's page keys (no allocation per event)
};

// Parses a 32-byte wire hash. Returns false for any other length.
bool BlockHashFromBytes(const std::string& bytes, BlockHash* out);

}  // namespace kvcache::router

#endif  // KVCACHE_ROUTER_DIRECTORY_H_
