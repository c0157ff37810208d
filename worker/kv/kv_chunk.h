// Wire-neutral chunks of a session export, each well under 4 MiB, so a later layer
// can stream them over gRPC one message per chunk.
//
// A stream is:  kBegin, then kTokens / kPages chunks in any order (a page or token
// range may be sent again: the later copy wins), then one kCommit.
//
//   kBegin   session_id, tenant, model_id, shape
//   kTokens  token_ids for positions [token_offset, token_offset + token_ids.size());
//            the receiver's token list is cut to token_offset before appending
//   kPages   segments of pages; payload is the segments' bytes back to back.
//            A segment with offset 0 restarts its page; a page is checked against
//            `page_checksum` (XXH3-64 of the whole page) once all its bytes arrived
//   kCommit  num_tokens, first_live_page and the checksum of every live page
//            [first_live_page, ceil(num_tokens / page_tokens)), in order
//
// Thread-safety: plain values.
#ifndef KVCACHE_WORKER_KV_KV_CHUNK_H_
#define KVCACHE_WORKER_KV_KV_CHUNK_H_

#include <cstdint>
#include <string>
#include <vector>

#include "worker/kv/kv_shape.h"
#include "worker/kv/tier_storage.h"

namespace kvcache::kv {

inline constexpr int64_t kMaxChunkWireBytes = 4 << 20;  // hard limit of one message
inline constexpr int64_t kDefaultChunkBytes = 2 << 20;  // default payload budget

struct PageSegment {
  int64_t page_index = 0;          // index in the session's page table
  int64_t offset = 0;              // byte offset within the page
  int64_t length = 0;              // bytes of this segment in the payload
  PageChecksum page_checksum = 0;  // of the whole page
};

struct KvChunk {
  enum class Kind : uint8_t { kBegin, kTokens, kPages, kCommit };
  Kind kind = Kind::kBegin;
  // kBegin
  std::string session_id;
  std::string tenant;
  std::string model_id;
  KvShape shape;
  // kTokens
  int64_t token_offset = 0;
  std::vector<int32_t> token_ids;
  // kPages
  std::vector<PageSegment> segments;
  std::vector<uint8_t> payload;
  // kCommit
  int64_t num_tokens = 0;
  int64_t first_live_page = 0;
  std::vector<PageChecksum> page_checksums;

  // Upper bound of the serialised size: payload plus fixed-size fields.
  int64_t ByteSize() const {
    return 128 + static_cast<int64_t>(session_id.size() + tenant.size() + model_id.size()) +
           static_cast<int64_t>(token_ids.size()) * 4 + static_cast<int64_t>(segments.size()) * 32 +
           static_cast<int64_t>(payload.size()) + static_cast<int64_t>(page_checksums.size()) * 8;
  }
};

}  // namespace kvcache::kv

#endif  // KVCACHE_WORKER_KV_KV_CHUNK_H_
