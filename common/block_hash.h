// Chained, collision-resistant identity of a full KV page, shared by the worker's
// prefix cache and the router's prefix-affinity index.
//
//   hash(page i) = SHA-256(hash(page i-1) || len(model_id) || model_id ||
//                          len(tenant_salt) || tenant_salt || tokens of page i as int32 LE)
//   hash(page -1) = 32 zero bytes.
//
// Lengths are 8-byte little-endian so that ("ab","c") and ("a","bc") differ. The
// tenant salt keeps one tenant from probing another tenant's cache: the same tokens
// under different salts never share a hash.
//
// Thread-safety: free functions and plain values; safe from any thread.
#ifndef KVCACHE_COMMON_BLOCK_HASH_H_
#define KVCACHE_COMMON_BLOCK_HASH_H_

#include <array>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace kvcache {

// A 256-bit SHA-256 digest. Value type, hashable by absl containers.
struct BlockHash {
  std::array<uint8_t, 32> bytes{};

  // The root parent: all zeros.
  static BlockHash Zero() { return BlockHash{}; }
  bool IsZero() const { return *this == BlockHash{}; }
  // 64 lowercase hex digits.
  std::string ToHex() const;
  // Parses 64 hex digits; returns false on malformed input.
  static bool FromHex(absl::string_view hex, BlockHash* out);

  friend bool operator==(const BlockHash& a, const BlockHash& b) { return a.bytes == b.bytes; }
  friend bool operator!=(const BlockHash& a, const BlockHash& b) { return !(a == b); }
  friend bool operator<(const BlockHash& a, const BlockHash& b) { return a.bytes < b.bytes; }
  template <typename H>
  friend H AbslHashValue(H h, const BlockHash& b) {
    // Already uniformly distributed: the first 8 bytes are enough.
    uint64_t v;
    std::memcpy(&v, b.bytes.data(), sizeof(v));
    return H::combine(std::move(h), v);
  }
};

// Hash of one full page given its parent's hash.
BlockHash ComputeBlockHash(const BlockHash& parent, absl::string_view model_id, absl::string_view tenant_salt,
                           absl::Span<const int32_t> page_tokens);

// Hashes of every *full* page of `tokens` (tokens.size() / page_tokens entries),
// chained from the zero root.
// REQUIRES: page_tokens > 0.
std::vector<BlockHash> ChainBlockHashes(absl::Span<const int32_t> tokens, int page_tokens,
                                        absl::string_view model_id, absl::string_view tenant_salt);

}  // namespace kvcache

#endif  // KVCACHE_COMMON_BLOCK_HASH_H_
