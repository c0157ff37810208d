// Export and import of a session as a stream of KvChunks (kv_chunk.h), for
// migration between workers.
//
// Export is pre-copy: SessionExporter::NextBulk() streams the session's full pages as
// of Create() while the session keeps decoding; NextFinal() then freezes the session
// briefly and sends only what changed since (pages written or added, the token tail)
// plus the commit chunk. Downtime is proportional to what changed, not to context.
//
// Import stages pages where no session can see them (tier 0, or tier 1 when tier 0
// is held by sessions that cannot move: the session then arrives offloaded), verifies every page's
// checksum, the shape and the model id, and on the commit chunk creates the session
// atomically. Any error frees the staging pages: the cache is as before the import.
//
// Both reach the manager only through its KvTransferPort (kv_transfer_port.h): each
// call there takes the manager's lock for that call alone, so an exporter holds the
// lock while it reads one page segment, an importer while it stages or writes one.
//
// Thread-safety: an exporter or importer is used by one thread at a time; any number
// of them may run concurrently with each other and with the manager's other callers.
// REQUIRES (both): the manager outlives them.
#ifndef KVCACHE_WORKER_KV_KV_TRANSFER_H_
#define KVCACHE_WORKER_KV_KV_TRANSFER_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "worker/kv/kv_cache_manager.h"
#include "worker/kv/kv_chunk.h"
#include "worker/kv/kv_transfer_port.h"

namespace kvcache::kv {

struct ExportOptions {
  // Upper bound of KvChunk::ByteSize() for token and page chunks; pages larger than
  // this are split into segments. REQUIRES: 1 KiB <= max_chunk_bytes <= 4 MiB.
  int64_t max_chunk_bytes = kDefaultChunkBytes;
};

class SessionExporter {
 public:
  static absl::StatusOr<std::unique_ptr<SessionExporter>> Create(KvCacheManager* manager,
                                                                 const std::string& session_id,
                                                                 ExportOptions options = {});
  // Unfreezes the session if the final phase was started but not finished.
  ~SessionExporter();
  SessionExporter(const SessionExporter&) = delete;
  SessionExporter& operator=(const SessionExporter&) = delete;

  // Bulk phase: kBegin, then tokens and full pages as they were at Create(), read
  // from whichever tier holds them. Pages written since Create() are skipped (the
  // final phase sends them). Returns false when the bulk phase has nothing left.
  // FAILED_PRECONDITION when the session was closed (or replaced) meanwhile.
  absl::StatusOr<bool> NextBulk(KvChunk* out);
  // Final phase. The first call freezes the session (FAILED_PRECONDITION while it is
  // in a step: call between steps) so it neither changes nor moves; chunks then carry
  // the pages written or added since Create() and not yet sent, the changed token
  // tail, and last the kCommit chunk, after which the session is unfrozen and a
  // kSessionExported event is emitted. Returns false after the kCommit chunk.
  absl::StatusOr<bool> NextFinal(KvChunk* out);

  int64_t bulk_pages() const { return bulk_pages_; }    // pages sent by NextBulk
  int64_t final_pages() const { return final_pages_; }  // pages sent by NextFinal

 private:
  SessionExporter(KvTransferPort* p, ExportOptions o) : port_(p), options_(o) {}
  enum class Phase { kBegin, kBulk, kFinalStart, kFinal, kDone };
  // Fills `out` with token chunks first, then page chunks; false when both are done.
  absl::StatusOr<bool> Fill(bool bulk, KvChunk* out);
  void Unfreeze();

  KvTransferPort* const port_;
  const ExportOptions options_;
  ExportHandle session_;
  std::string tenant_;
  uint64_t epoch0_ = 0;  // the manager's write epoch at Create()
  Phase phase_ = Phase::kBegin;
  bool frozen_ = false;
  std::vector<int32_t> tokens_;  // tokens to send in the current phase
  int64_t token_base_ = 0;       // position of tokens_[0]
  size_t token_pos_ = 0;         // next index of tokens_ to send
  std::vector<int64_t> todo_;    // page indices to send in the current phase
  size_t todo_pos_ = 0;
  int64_t page_offset_ = 0;  // bytes of todo_[todo_pos_] already sent
  PageChecksum page_sum_ = 0;
  std::vector<PageChecksum> sent_sum_;  // per page index, valid when sent_ok_
  std::vector<char> sent_ok_;
  int64_t bulk_token_end_ = 0;  // tokens [0, bulk_token_end_) were sent in bulk
  int64_t bulk_pages_ = 0;
  int64_t final_pages_ = 0;
};

// Bulk and final phases back to back.
absl::StatusOr<std::vector<KvChunk>> ExportSession(KvCacheManager* manager, const std::string& session_id,
                                                   ExportOptions options = {});

struct ImportOptions {
  std::string session_id;  // empty: the id carried by the kBegin chunk
};

class SessionImporter {
 public:
  static absl::StatusOr<std::unique_ptr<SessionImporter>> Create(KvCacheManager* manager,
                                                                 ImportOptions options = {});
  // Frees staging pages unless the import committed.
  ~SessionImporter();
  SessionImporter(const SessionImporter&) = delete;
  SessionImporter& operator=(const SessionImporter&) = delete;

  // Feeds one chunk; the kCommit chunk verifies and commits. Errors abort the import
  // (staging freed, nothing visible) and name the session:
  //   DATA_LOSS            a page's bytes do not match its checksum
  //   FAILED_PRECONDITION  model id or shape differ from this cache; import aborted
  //   INVALID_ARGUMENT     malformed chunk, chunk order, missing pages or tokens
  //   ALREADY_EXISTS       the session id is in use
  //   RESOURCE_EXHAUSTED   no room for staging in either tier after the pressure policy
  absl::Status Add(const KvChunk& chunk);
  bool committed() const { return committed_; }
  const std::string& session_id() const { return session_id_; }
  // Pages the chunks so far carried (by the commit chunk: every live page of the
  // session), all or those staged in `tier`.
  int64_t staged_pages() const { return staged_pages(0) + staged_pages(1); }
  int64_t staged_pages(int tier) const;

 private:
  SessionImporter(KvTransferPort* p, ImportOptions o) : port_(p), options_(std::move(o)) {}
  struct Staged {
    StagingPage page;
    int64_t received = 0;
    PageChecksum sum = 0;
    bool verified = false;
  };
  absl::Status AddChunk(const KvChunk& chunk);
  absl::Status AddPages(const KvChunk& chunk);
  absl::Status Commit(const KvChunk& chunk);
  // Frees the staging pages still held (none after a commit attempt).
  void Abort();

  KvTransferPort* const port_;
  const ImportOptions options_;
  std::string session_id_;
  std::string tenant_;
  bool began_ = false;
  bool committed_ = false;
  absl::Status failed_;
  std::vector<int32_t> tokens_;
  std::vector<Staged> staged_;  // by page index
};

// Feeds every chunk to a new importer.
absl::Status ImportSession(KvCacheManager* manager, absl::Span<const KvChunk> chunks,
                           ImportOptions options = {});

}  // namespace kvcache::kv

#endif  // KVCACHE_WORKER_KV_KV_TRANSFER_H_
