// The one place where absl::Status and grpc::Status meet.
//
// Library code returns absl::Status; service edges convert with ToGrpcStatus and
// clients convert back with FromGrpcStatus. Codes map one to one (both follow
// google.rpc.Code).
//
// Thread-safety: free functions, no state.
#ifndef KVCACHE_COMMON_STATUS_H_
#define KVCACHE_COMMON_STATUS_H_

#include "absl/status/status.h"
#include "common/status_macros.h"
#include "grpcpp/support/status.h"

namespace kvcache {

// The message of the UNAVAILABLE a draining worker answers new work with. A
// router that sees it knows the worker is alive and its sessions are on their
// way elsewhere (not lost), even before the worker's Watch stream says so.
inline constexpr char kWorkerDrainingMessage[] = "worker is draining";
// The status message of a Generate stream that a draining worker cut after
// --drain_deadline (UNAVAILABLE): the session kept every token the stream
// delivered and moves to another worker; an APPEND continues it there.
inline constexpr char kStreamCutByDrainMessage[] =
    "worker is draining: stream cut; the session keeps the tokens sent and moves to another worker";

// How a worker's RESOURCE_EXHAUSTED for a request begins when its tier 0 has no
// page for it: running requests, pinned sessions and sessions moving in or out
// hold the rest. Another worker may have room: a router moves an APPEND's
// session to one that has, and runs the request there.
inline constexpr char kNoKvMemoryMessage[] = "no KV cache memory";
// How a worker's OUT_OF_RANGE for a request begins when its context needs more
// KV pages than the worker's whole tier 0 holds: a worker with a larger tier 0
// may hold it, and a router moves an APPEND's session to one with room.
inline constexpr char kContextOverTier0Message[] = "context over this worker's tier 0";
// Trailing metadata of a Generate stream that a worker ended with an error
// after tokens: the request's kvcache.v1.Usage so far, serialised, so that a
// router that goes on the stream elsewhere reports the turn's usage (its
// prompt was served by this part).
inline constexpr char kUsageTrailer[] = "kvcache-usage-bin";

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace kvcache

#endif  // KVCACHE_COMMON_STATUS_H_
