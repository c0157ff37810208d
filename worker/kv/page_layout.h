// Byte layout of a KV page, as the KV cache lays it out and the kernels (CPU and
// CUDA) address it. KvShape::layout() gives it for a cache's shape.
//
// A page is one contiguous block holding `page_tokens` token slots of every layer:
//
//   page: [layers][2 (K, V)][page_tokens][kv_heads][head_dim]   of `dtype`
//   slab: [n_pages][page_bytes]          page address = base + page_id * page_bytes
//
// Every helper is KV_HD (host and, under nvcc, device) so a CUDA backend can share it.
//
// Thread-safety: a plain value with pure inline helpers; safe from any thread.
#ifndef KVCACHE_WORKER_KV_PAGE_LAYOUT_H_
#define KVCACHE_WORKER_KV_PAGE_LAYOUT_H_

#include <cstdint>

#include "common/gguf/fp16.h"  // KV_HD

namespace kvcache::kv {

enum class KvDtype : uint8_t { kF32 = 0, kF16 = 1, kBF16 = 2 };

KV_HD inline int64_t KvDtypeSize(KvDtype d) { return d == KvDtype::kF32 ? 4 : 2; }

struct PageLayout {
  int layers = 0;
  int kv_heads = 0;
  int head_dim = 0;
  int page_tokens = 16;
  KvDtype dtype = KvDtype::kF16;

  KV_HD int64_t elt_bytes() const { return KvDtypeSize(dtype); }
  // Elements in one token's K (or V) row of one layer: [kv_heads][head_dim].
  KV_HD int64_t row_elems() const { return int64_t{kv_heads} * head_dim; }
  KV_HD int64_t row_bytes() const { return row_elems() * elt_bytes(); }
  // 2 * layers * page_tokens * kv_heads * head_dim * elt.
  KV_HD int64_t page_bytes() const { return 2 * int64_t{layers} * page_tokens * row_bytes(); }
  // Byte offset within a page of layer `layer`'s K row for `slot`.
  // REQUIRES: 0 <= layer < layers, 0 <= slot < page_tokens.
  KV_HD int64_t k_offset(int layer, int slot) const {
    return (int64_t{layer} * 2 * page_tokens + slot) * row_bytes();
  }
  // Byte offset of layer `layer`'s V row for `slot` (after that layer's K block).
  KV_HD int64_t v_offset(int layer, int slot) const {
    return ((int64_t{layer} * 2 + 1) * page_tokens + slot) * row_bytes();
  }
  // Address of page `page_id` in a slab starting at `base`.
  KV_HD const uint8_t* page(const void* base, int32_t page_id) const {
    return static_cast<const uint8_t*>(base) + int64_t{page_id} * page_bytes();
  }
  KV_HD uint8_t* page(void* base, int32_t page_id) const {
    return static_cast<uint8_t*>(base) + int64_t{page_id} * page_bytes();
  }
};

}  // namespace kvcache::kv

#endif  // KVCACHE_WORKER_KV_PAGE_LAYOUT_H_
