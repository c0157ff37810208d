// KV write and paged attention over the KV page slab (layout: worker/kv/page_layout.h).
//
// Attention is causal, GQA-aware (n_heads / kv_heads query heads share each kv
// head; MHA and MQA are the edge cases) and uses an online (flash-style) softmax
// in f32. The K/V of one kv head is read once for its whole query-head group and
// for a block of query tokens. f16 K/V is widened with F16C, bf16 with shifts.
// With AVX-512 (head_dim a multiple of 16, up to 128) keys go in blocks of 16:
// a block's K is widened once into scratch for every row that shares it, one
// register holds a row's 16 scores (dot products summed across lanes by a
// shuffle tree), and P·V runs for all rows of a kv head at once, widening V as
// it reads it. The same rows of the next page are prefetched into L2 while a
// block is read, since a session's pages lie anywhere in the slab (into L1 the
// prefetches held the fill buffers that the loads need: 13-15 against 20-27 GB/s
// of K/V on two Zen 4 cores). With AVX2 (head_dim a multiple of 8, up to 128)
// the same design runs on blocks of 8 keys, except that a decode token of a GQA
// group of up to 3 heads reads K and V straight from the page, widening each
// chunk once in registers for the group's rows; other head_dims take the scalar
// loop, which is also the reference.
// Work is split over (sequence, kv head, query block, key range) items with
// ComputePool (NumThreads() threads, longest first); long key ranges are cut
// into page-aligned splits whose partial softmax states are merged, so a batch of
// very different lengths (or a single long decode) keeps every thread busy.
//
// Thread-safety: reentrant. Concurrent calls may read the same pages; a call
// must not run while another thread writes the pages it reads.
#ifndef KVCACHE_WORKER_BACKEND_CPU_ATTENTION_H_
#define KVCACHE_WORKER_BACKEND_CPU_ATTENTION_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "worker/kv/page_layout.h"

namespace kvcache::cpu {

// The KV cache's page layout (one definition, owned by worker/kv).
using kv::KvDtype;
using kv::KvDtypeSize;
using kv::PageLayout;

// Stores n_tokens tokens' K and V of one layer at positions first_pos.. of a
// sequence, converting f32 to layout.dtype (f16/bf16 round to nearest even).
//   k, v: [n_tokens][kv_heads][head_dim] f32
//   slab: page page_table[pos / page_tokens], slot pos % page_tokens.
// REQUIRES: base is a slab of pages of layout.page_bytes(); no other thread
//   reads or writes those slots meanwhile.
// INVALID_ARGUMENT when the layer or a position is outside the layout/page table.
absl::Status WriteKv(const PageLayout& layout, void* base, absl::Span<const int32_t> page_table, int layer,
                     int first_pos, int n_tokens, const float* k, const float* v);

// One sequence of a batch. Its query tokens are the last n_query of its n_cached
// tokens (positions n_cached - n_query .. n_cached - 1), whose K/V are already
// written: decode is n_query = 1, a prefill chunk n_query > 1 (causal).
struct AttentionSeq {
  absl::Span<const int32_t> page_table;  // page ids, >= ceil(n_cached / page_tokens)
  int n_cached = 0;                      // REQUIRES >= n_query
  int n_query = 0;                       // REQUIRES >= 0
};

struct AttentionParams {
  PageLayout layout;
  const void* kv_base = nullptr;  // slab [n_pages][layout.page_bytes()]
  int layer = 0;
  int n_heads = 0;         // query heads; REQUIRES multiple of layout.kv_heads
  float scale = 0.0f;      // softmax scale; 0 means 1 / sqrt(head_dim)
  int sliding_window = 0;  // > 0: a query at p sees keys at positions > p - window
};

// For every sequence s (in order) and its query tokens i:
//   out[row][h] = sum_j softmax_j(scale * q[row][h] · K[j][h / group]) V[j][h / group]
// over visible keys j, where row runs over the query tokens of all sequences
// concatenated in order.
//   q, out: [sum n_query][n_heads][head_dim] f32 (must not overlap)
// INVALID_ARGUMENT for inconsistent shapes (heads, layer, page table too short).
absl::Status PagedAttention(const AttentionParams& params, absl::Span<const AttentionSeq> seqs,
                            const float* q, float* out);

}  // namespace kvcache::cpu

#endif  // KVCACHE_WORKER_BACKEND_CPU_ATTENTION_H_
