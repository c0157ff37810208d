// Paged attention on the GPU: KV write and attention over the tier-0 page slab.
//
//   slab: [n_pages][page_bytes], page: [layers][2 (K,V)][page_tokens][kv_heads][head_dim]
//
// One kernel serves decode and chunked prefill: every new token is a query item
// (its sequence and position) attending causally to keys [FirstVisibleKey(pos),
// pos] read only through its sequence's page table. A thread block takes one
// (split of kAttentionSplitTokens keys, kv head, item) and all query heads of that
// kv head's group (GQA: each K/V row is read once for the whole group), reading
// K and V in one pass with an online softmax kept in registers; the kv heads of a
// split are neighbouring blocks, so a page's rows are fetched together. Splits
// keep thousands of blocks busy for long contexts (flash-decoding) and are merged
// by a second kernel with the online-softmax rule (kernel_math.h). In a prefill
// chunk the items of one sequence read the same pages, mostly from L2.
// H200, 64 sessions x 4096 keys, SmolLM2 shape: see gpu_bench attention_vs_hbm.
// Scores and the softmax are f32; K/V are f16 or bf16 (no f32 KV on the GPU).
//
// Host-only header: no CUDA include.
//
// Thread-safety: launchers are reentrant; ordering is the stream's.
#ifndef KVCACHE_WORKER_BACKEND_CUDA_ATTENTION_H_
#define KVCACHE_WORKER_BACKEND_CUDA_ATTENTION_H_

#include <cstdint>

#include "absl/status/status.h"
#include "worker/backend/cuda/stream.h"
#include "worker/kv/page_layout.h"

namespace kvcache::cuda {

// A query token: index of its sequence in the step, and its position (-1: a
// padding row, which reads and writes nothing).
struct AttentionItem {
  int32_t seq = 0;
  int32_t pos = 0;
};

// OK when the kernels handle this shape: head_dim 32, 64 or 128; f16/bf16 KV;
// n_heads a multiple of kv_heads with a group of at most kMaxAttentionGroup.
absl::Status AttentionSupports(const kv::PageLayout& layout, int n_heads);

struct WriteKvArgs {
  kv::PageLayout layout;
  void* kv_base = nullptr;  // device slab
  int layer = 0;
  int n_tokens = 0;
  const float* k = nullptr;           // device, row t at k + t * row_stride: [kv_heads][head_dim]
  const float* v = nullptr;           // same for V
  int64_t row_stride = 0;             // floats between consecutive tokens' rows
  const int32_t* dst_page = nullptr;  // device [n_tokens]: tier-0 page of each token, -1: none
  const int32_t* dst_slot = nullptr;  // device [n_tokens]: slot within that page
};
// Stores K and V of n_tokens tokens of one layer, f32 -> KV dtype (round to
// nearest even, bit-exact with the CPU backend).
absl::Status WriteKv(const WriteKvArgs& args, cudaStream_t stream);

struct AttentionArgs {
  kv::PageLayout layout;
  const void* kv_base = nullptr;  // device slab
  int layer = 0;
  int n_heads = 0;
  float scale = 0.0f;  // 0: 1 / sqrt(head_dim)
  int sliding_window = 0;
  const int32_t* page_tables = nullptr;      // device: every sequence's page table, concatenated
  const int32_t* seq_page_offset = nullptr;  // device [n_seqs]: start of each table
  const AttentionItem* items = nullptr;      // device [n_items]
  int n_items = 0;
  int max_splits = 0;        // max over items of AttentionSplits(pos, window)
  const float* q = nullptr;  // device: item i, head h at q + i*q_row_stride + h*head_dim
  int64_t q_row_stride = 0;
  float* scratch = nullptr;     // device, AttentionScratchFloats(...) floats
  uint16_t* out_f16 = nullptr;  // device [n_items][n_heads][head_dim] f16, or null
  float* out_f32 = nullptr;     // same as f32, or null
};
int64_t AttentionScratchFloats(int n_items, int n_heads, int head_dim, int max_splits);
// out[i][h] = softmax_j(scale q[i][h]·K[j][h/group]) · V[j][h/group] over the
// item's visible keys. REQUIRES: AttentionSupports; every page the items need is
// in their tables; n_items <= 65535, max_splits <= 65535.
absl::Status PagedAttention(const AttentionArgs& args, cudaStream_t stream);

}  // namespace kvcache::cuda

#endif  // KVCACHE_WORKER_BACKEND_CUDA_ATTENTION_H_
