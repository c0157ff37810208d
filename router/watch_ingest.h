// WatchIngest: applies one worker's Watch stream to a Directory, message by
// message, in the order the stream delivers them.
//
// It checks sequence numbers (a stream starts at 1 with a snapshot and grows by
// one per message) and gathers a snapshot sent in parts, applying it whole once
// the last part is in. A message out of sequence (lost, duplicated, reordered)
// or anything but a snapshot part inside a snapshot is a gap: Ingest answers
// DATA_LOSS and applies nothing more until Reset(). The caller resyncs by
// opening a new stream (which starts with a fresh snapshot that replaces what
// the directory knew of the worker) and calling Reset(). The router's
// WorkerPool and the fleet simulator (tests/bench/fleet_sim.h) both ingest
// through this class, so the benchmark measures the router's own path.
//
// Thread-safety: none; one instance per stream, used by the stream's reader.
#ifndef KVCACHE_ROUTER_WATCH_INGEST_H_
#define KVCACHE_ROUTER_WATCH_INGEST_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "kvcache/v1/worker.pb.h"
#include "router/directory.h"

namespace kvcache::router {

class WatchIngest {
 public:
  enum class Applied {
    kSnapshot,      // a whole snapshot: the message now holds all of its parts
    kSnapshotPart,  // a part gathered; nothing applied yet
    kEvent,
    kLoad,
    kNone,  // a message with no payload (a newer kind this router ignores)
  };

  // REQUIRES: `directory` outlives this object.
  WatchIngest(Directory* directory, WorkerId worker);

  // Applies `ev` (consumes its payload). DATA_LOSS on a gap, and on every call
  // after one until Reset().
  absl::StatusOr<Applied> Ingest(v1::WatchEvent* ev);
  // A new stream begins: expect sequence 1.
  void Reset();

  uint64_t expected_sequence() const { return expected_; }
  // Messages refused as gaps since construction (counts each broken stream once).
  uint64_t gaps() const { return gaps_; }

 private:
  Directory* const directory_;
  const WorkerId worker_;
  uint64_t expected_ = 1;
  bool broken_ = false;
  bool gathering_ = false;
  v1::WorkerSnapshot parts_;
  uint64_t gaps_ = 0;
};

}  // namespace kvcache::router

#endif  // KVCACHE_ROUTER_WATCH_INGEST_H_
