// The model shape the KV cache is laid out for, and the byte layout of a page.
//
// A page is ONE contiguous block of page_bytes() holding `page_tokens` consecutive
// token slots for every layer:
//
//   page: [layers][2 (K, V)][page_tokens][kv_heads][head_dim]   of dtype
//   slab: [n_pages][page_bytes]                                  (one per tier)
//
// so moving a page between tiers or workers is one contiguous copy, and the engine
// finds layer l's K for slot s at KOffset(shape, l, s) within the page; V of the same
// layer follows that layer's K block. MHA, GQA and MQA differ only in kv_heads.
//
// Thread-safety: plain values and pure functions; safe from any thread.
#ifndef KVCACHE_WORKER_KV_KV_SHAPE_H_
#define KVCACHE_WORKER_KV_KV_SHAPE_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "worker/kv/page_layout.h"

namespace kvcache::kv {

// Size in bytes of one element; 0 for an unknown value.
inline int64_t DtypeSize(KvDtype d) {
  switch (d) {
    case KvDtype::kF32:
      return 4;
    case KvDtype::kF16:
      return 2;
    case KvDtype::kBF16:
      return 2;
  }
  return 0;
}
const char* DtypeName(KvDtype d);
// "f16", "bf16" or "f32" (--kv_dtype); INVALID_ARGUMENT naming the choices.
absl::StatusOr<KvDtype> ParseDtype(absl::string_view name);

// The KV budget flags one rule for the worker and the tools that size against
// them: --tier0_bytes > 0, --tier1_bytes >= 0, --page_tokens in [1, 1024].
// INVALID_ARGUMENT naming the flag.
absl::Status ValidateBudgetFlags(int64_t tier0_bytes, int64_t tier1_bytes, int64_t page_tokens);

struct KvShape {
  int layers = 0;
  int kv_heads = 0;
  int head_dim = 0;
  KvDtype dtype = KvDtype::kF16;
  int page_tokens = 16;
  int sliding_window = 0;  // tokens; 0 = full attention

  // Bytes of one token's K and V over all layers: 2 * layers * kv_heads * head_dim * dtype.
  int64_t bytes_per_token() const { return 2 * int64_t{layers} * kv_heads * head_dim * DtypeSize(dtype); }
  int64_t page_bytes() const { return int64_t{page_tokens} * bytes_per_token(); }
  // Bytes of one K (or V) row of one token in one layer: kv_heads * head_dim * dtype.
  int64_t row_bytes() const { return int64_t{kv_heads} * head_dim * DtypeSize(dtype); }
  // The page's byte layout as the kernels address it.
  PageLayout layout() const { return PageLayout{layers, kv_heads, head_dim, page_tokens, dtype}; }
  std::string DebugString() const;

  friend bool operator==(const KvShape& a, const KvShape& b) {
    return a.layers == b.layers && a.kv_heads == b.kv_heads && a.head_dim == b.head_dim &&
           a.dtype == b.dtype && a.page_tokens == b.page_tokens && a.sliding_window == b.sliding_window;
  }
  friend bool operator!=(const KvShape& a, const KvShape& b) { return !(a == b); }
};

// INVALID_ARGUMENT unless every dimension is positive, the dtype known, the window
// non-negative and a page fits in 1 GiB.
absl::Status ValidateShape(const KvShape& shape);

// Byte offset, within a page, of layer `layer`'s K row for slot `slot`
// ([kv_heads][head_dim] elements follow contiguously).
// REQUIRES: 0 <= layer < layers, 0 <= slot < page_tokens.
inline int64_t KOffset(const KvShape& s, int layer, int slot) { return s.layout().k_offset(layer, slot); }
// Byte offset of layer `layer`'s V row for slot `slot`: right after that layer's K block.
inline int64_t VOffset(const KvShape& s, int layer, int slot) { return s.layout().v_offset(layer, slot); }

}  // namespace kvcache::kv

#endif  // KVCACHE_WORKER_KV_KV_SHAPE_H_
