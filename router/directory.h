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
// router that missed events (a sequence gap) resyncs by asking for a new one.
//
// Thread-safety: all methods take an internal lock; safe from any thread.
#ifndef KVCACHE_ROUTER_DIRECTORY_H_
#define KVCACHE_ROUTER_DIRECTORY_H_

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
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
  // Replaces everything known about `worker` with `snapshot`.
  void ApplySnapshot(const WorkerId& worker, const v1::WorkerSnapshot& snapshot);
  // Applies one cache event from `worker`'s stream.
  void ApplyEvent(const WorkerId& worker, const v1::CacheEvent& event);
  void ApplyLoad(const WorkerId& worker, const v1::WorkerLoad& load);
  // Forgets a worker (it went down or left the fleet): its sessions and pages
  // are no longer anywhere. Returns the sessions that were lost with it.
  std::vector<SessionKey> RemoveWorker(const WorkerId& worker);

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
  // (the same code, message and wait either way). Blocks up to `timeout`.
  absl::StatusOr<SessionLocation> Lookup(const SessionKey& key, absl::Duration timeout) const;
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

 private:
  struct PageHolders {
    // worker -> tier bitmask (1 = device, 2 = host)
    absl::flat_hash_map<WorkerId, uint8_t> workers;
  };
  struct WorkerState {
    v1::WorkerSnapshot info;  // sessions/hashes cleared: kept for model id and shape
    v1::WorkerLoad load;
    int64_t sessions = 0;  // entries of sessions_ on this worker
  };

  void AddPageLocked(const BlockHash& h, const WorkerId& w, uint8_t tier_bit)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RemovePageLocked(const BlockHash& h, const WorkerId& w, uint8_t tier_bit)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ForgetWorkerLocked(const WorkerId& w, std::vector<SessionKey>* lost_sessions)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // sessions_[loc.key()] = loc, keeping the per-worker counts.
  void PutSessionLocked(const SessionLocation& loc) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EraseSessionLocked(absl::flat_hash_map<SessionKey, SessionLocation>::iterator it)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  absl::flat_hash_map<SessionKey, SessionLocation> sessions_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<BlockHash, PageHolders> pages_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<WorkerId, WorkerState> workers_ ABSL_GUARDED_BY(mu_);
};

// Parses a 32-byte wire hash. Returns false for any other length.
bool BlockHashFromBytes(const std::string& bytes, BlockHash* out);

}  // namespace kvcache::router

#endif  // KVCACHE_ROUTER_DIRECTORY_H_
