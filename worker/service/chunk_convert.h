// KV export chunks (worker/kv/kv_chunk.h) to and from their wire form
// (kvcache.v1.SessionChunk). Decoding validates sizes and fields so that a
// hostile stream is rejected here with INVALID_ARGUMENT before it reaches the
// importer (which verifies checksums, shape and model).
//
// Thread-safety: pure functions.
#ifndef KVCACHE_WORKER_SERVICE_CHUNK_CONVERT_H_
#define KVCACHE_WORKER_SERVICE_CHUNK_CONVERT_H_

#include <vector>

#include "absl/status/statusor.h"
#include "kvcache/v1/worker.pb.h"
#include "worker/kv/kv_chunk.h"

namespace kvcache::service {

// `context` (the engine's whole conversation) rides on the commit chunk only.
v1::SessionChunk ToWire(const kv::KvChunk& chunk, int32_t index, const std::vector<int32_t>& context);

// INVALID_ARGUMENT for an unknown kind, a bad dtype, negative or inconsistent
// sizes (segment lengths must add up to the payload). `context` receives the
// commit chunk's context tokens.
absl::StatusOr<kv::KvChunk> FromWire(const v1::SessionChunk& chunk, std::vector<int32_t>* context);

}  // namespace kvcache::service

#endif  // KVCACHE_WORKER_SERVICE_CHUNK_CONVERT_H_
