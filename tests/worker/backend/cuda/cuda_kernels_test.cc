// GPU kernels against the CPU backend. Tolerances: attention outputs within 5e-4
// absolute (values are O(1): f32 softmax in a different summation order; K/V are
// the same f16 bytes); KV write bit-exact; RMSNorm / SwiGLU outputs are f16, so
// within one f16 rounding (2^-10 relative) plus 1e-5. Weight kernels against
// gguf::DequantizeRow on the host: decoded values within one f16 rounding, dot
// products within 1e-5 of sum |w x| (f32 sums in another order).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "common/gguf/fp16.h"
#include "common/gguf/ggml_types.h"
#include "gtest/gtest.h"
#include "tests/worker/backend/cuda/gpu_test_util.h"
#include "worker/backend/cpu/attention.h"
#include "worker/backend/cpu/ops.h"
#include "worker/backend/cuda/activation.h"
#include "worker/backend/cuda/attention.h"
#include "worker/backend/cuda/kernel_math.h"
#include "worker/backend/cuda/norm_rope.h"
#include "worker/backend/cuda/weight_kernels.h"

namespace kvcache::cuda {
namespace {

std::vector<float> Random(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-scale, scale);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng);
  return v;
}

template <typename T>
DeviceBuffer Upload(const std::vector<T>& v) {
  DeviceBuffer b =
      std::move(DeviceBuffer::Allocate(static_cast<int64_t>(v.size() * sizeof(T)) + 16, "test")).value();
  EXPECT_EQ(cudaMemcpy(b.get(), v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  return b;
}
template <typename T>
std::vector<T> Download(const DeviceBuffer& b, size_t n) {
  std::vector<T> v(n);
  EXPECT_EQ(cudaMemcpy(v.data(), b.get(), n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  return v;
}

struct SeqSpec {
  int n_cached;
  int n_query;
};

// Attention over a batch of decode and prefill sequences vs cpu::PagedAttention.
void CheckAttention(int head_dim, int kv_heads, int n_heads, kv::KvDtype dtype, int window,
                    const std::vector<SeqSpec>& specs) {
  kv::PageLayout L;
  L.layers = 2;
  L.kv_heads = kv_heads;
  L.head_dim = head_dim;
  L.page_tokens = 16;
  L.dtype = dtype;
  const int layer = 1;
  int total_pages = 0;
  for (const SeqSpec& s : specs) total_pages += (s.n_cached + 15) / 16;
  std::vector<int32_t> perm(total_pages);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), std::mt19937(7));
  std::vector<uint8_t> slab(static_cast<size_t>(total_pages) * L.page_bytes());
  std::vector<std::vector<int32_t>> tables;
  std::vector<cpu::AttentionSeq> seqs;
  std::vector<AttentionItem> items;
  std::vector<int32_t> concat, offsets;
  int next = 0, n_items = 0, max_splits = 0;
  for (size_t si = 0; si < specs.size(); ++si) {
    const SeqSpec& s = specs[si];
    std::vector<int32_t> t(perm.begin() + next, perm.begin() + next + (s.n_cached + 15) / 16);
    next += static_cast<int>(t.size());
    const std::vector<float> k = Random(s.n_cached * L.row_elems(), 100 + si),
                             v = Random(s.n_cached * L.row_elems(), 200 + si);
    ASSERT_TRUE(cpu::WriteKv(L, slab.data(), t, layer, 0, s.n_cached, k.data(), v.data()).ok());
    offsets.push_back(static_cast<int32_t>(concat.size()));
    concat.insert(concat.end(), t.begin(), t.end());
    tables.push_back(std::move(t));
    for (int i = 0; i < s.n_query; ++i) {
      const int pos = s.n_cached - s.n_query + i;
      items.push_back(AttentionItem{static_cast<int32_t>(si), pos});
      max_splits = std::max(max_splits, AttentionSplits(pos, window));
    }
    n_items += s.n_query;
  }
  for (size_t si = 0; si < specs.size(); ++si)
    seqs.push_back({tables[si], specs[si].n_cached, specs[si].n_query});
  const std::vector<float> q = Random(static_cast<size_t>(n_items) * n_heads * head_dim, 300);
  std::vector<float> ref(q.size());
  cpu::AttentionParams ap;
  ap.layout = L;
  ap.kv_base = slab.data();
  ap.layer = layer;
  ap.n_heads = n_heads;
  ap.sliding_window = window;
  ASSERT_TRUE(cpu::PagedAttention(ap, seqs, q.data(), ref.data()).ok());

  DeviceBuffer d_slab = Upload(slab), d_tables = Upload(concat), d_off = Upload(offsets),
               d_items = Upload(items), d_q = Upload(q);
  DeviceBuffer scratch =
      std::move(
          DeviceBuffer::Allocate(AttentionScratchFloats(n_items, n_heads, head_dim, max_splits) * 4, "t"))
          .value();
  DeviceBuffer out = std::move(DeviceBuffer::Allocate(q.size() * 4, "t")).value();
  AttentionArgs a;
  a.layout = L;
  a.kv_base = d_slab.get();
  a.layer = layer;
  a.n_heads = n_heads;
  a.sliding_window = window;
  a.page_tables = d_tables.as<int32_t>();
  a.seq_page_offset = d_off.as<int32_t>();
  a.items = d_items.as<AttentionItem>();
  a.n_items = n_items;
  a.max_splits = max_splits;
  a.q = d_q.as<float>();
  a.q_row_stride = int64_t{n_heads} * head_dim;
  a.scratch = scratch.as<float>();
  a.out_f32 = out.as<float>();
  ASSERT_TRUE(PagedAttention(a, nullptr).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<float> got = Download<float>(out, q.size());
  float worst = 0;
  for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::fabs(got[i] - ref[i]));
  EXPECT_LE(worst, 5e-4f);
  std::printf("attention hd=%d group=%d window=%d items=%d: max |gpu - cpu| = %.2e\n", head_dim,
              n_heads / kv_heads, window, n_items, worst);
}

TEST(CudaKernelsTest, DecodeAttentionManySessionsOfDifferentLengths) {
  KVCACHE_REQUIRE_GPU();
  CheckAttention(64, 3, 9, kv::KvDtype::kF16, 0, {{1, 1}, {17, 1}, {256, 1}, {257, 1}, {1100, 1}, {4000, 1}});
  CheckAttention(128, 2, 16, kv::KvDtype::kBF16, 0, {{5, 1}, {700, 1}});
  CheckAttention(32, 4, 4, kv::KvDtype::kF16, 0, {{33, 1}, {513, 1}});
}

TEST(CudaKernelsTest, DecodeAttentionLargeBatchTakesLongerSplits) {
  KVCACHE_REQUIRE_GPU();
  // Enough (item, kv head) rows that PagedAttention merges 2 or 4 base splits into
  // one block (on a 132-multiprocessor H200: 4 here for hd 64, 2 for hd 32), with
  // one-split items among them.
  std::vector<SeqSpec> specs;
  for (int i = 0; i < 48; ++i) specs.push_back({1 + 160 * i, 1});
  CheckAttention(64, 3, 9, kv::KvDtype::kF16, 0, specs);
  specs.clear();
  for (int i = 0; i < 40; ++i) specs.push_back({7 + 150 * i, 1});
  CheckAttention(32, 4, 4, kv::KvDtype::kBF16, 0, specs);
}

TEST(CudaKernelsTest, PrefillAttentionCausalChunkReadingEarlierPages) {
  KVCACHE_REQUIRE_GPU();
  // A first chunk, a later chunk over earlier pages, and a decode in one batch.
  CheckAttention(64, 3, 9, kv::KvDtype::kF16, 0, {{64, 64}, {600, 37}, {300, 1}});
  CheckAttention(64, 3, 9, kv::KvDtype::kF16, 100, {{600, 37}, {300, 1}});  // sliding window
}

TEST(CudaKernelsTest, WriteKvBitExactWithCpu) {
  KVCACHE_REQUIRE_GPU();
  for (kv::KvDtype dtype : {kv::KvDtype::kF16, kv::KvDtype::kBF16}) {
    kv::PageLayout L;
    L.layers = 3;
    L.kv_heads = 3;
    L.head_dim = 64;
    L.dtype = dtype;
    const int n = 40, first = 9, layer = 2, stride = 5 * 192;
    const std::vector<int32_t> table = {3, 0, 2, 1};
    std::vector<float> rows = Random(static_cast<size_t>(n) * stride, 11, 30.0f);
    std::vector<float> k(n * L.row_elems()), v(n * L.row_elems());
    for (int t = 0; t < n; ++t) {
      std::copy_n(&rows[t * stride + 192], 192, &k[t * 192]);
      std::copy_n(&rows[t * stride + 384], 192, &v[t * 192]);
    }
    std::vector<uint8_t> slab(4 * L.page_bytes());
    ASSERT_TRUE(cpu::WriteKv(L, slab.data(), table, layer, first, n, k.data(), v.data()).ok());
    std::vector<int32_t> page(n), slot(n);
    for (int t = 0; t < n; ++t) {
      page[t] = table[(first + t) / 16];
      slot[t] = (first + t) % 16;
    }
    DeviceBuffer d_slab = Upload(std::vector<uint8_t>(slab.size(), 0)), d_rows = Upload(rows),
                 d_page = Upload(page), d_slot = Upload(slot);
    WriteKvArgs w;
    w.layout = L;
    w.kv_base = d_slab.get();
    w.layer = layer;
    w.n_tokens = n;
    w.k = d_rows.as<float>() + 192;
    w.v = d_rows.as<float>() + 384;
    w.row_stride = stride;
    w.dst_page = d_page.as<int32_t>();
    w.dst_slot = d_slot.as<int32_t>();
    ASSERT_TRUE(WriteKv(w, nullptr).ok());
    EXPECT_EQ(Download<uint8_t>(d_slab, slab.size()), slab);
  }
}

TEST(CudaKernelsTest, RmsNormRopeSwiGluMatchCpu) {
  KVCACHE_REQUIRE_GPU();
  const int t = 5;
  const int64_t n = 576;
  const std::vector<float> x = Random(t * n, 1, 3.0f), w = Random(n, 2);
  std::vector<float> ref(t * n);
  cpu::RmsNorm(x.data(), w.data(), t, n, 1e-5f, ref.data());
  DeviceBuffer dx = Upload(x), dw = Upload(w), dy = std::move(DeviceBuffer::Allocate(t * n * 2, "t")).value();
  const std::vector<int32_t> rows = {4, 0};
  DeviceBuffer drows = Upload(rows);
  ASSERT_TRUE(RmsNormToF16(dx.as<float>(), drows.as<int32_t>(), dw.as<float>(), 2, n, 1e-5f,
                           dy.as<uint16_t>(), nullptr)
                  .ok());
  std::vector<uint16_t> y = Download<uint16_t>(dy, 2 * n);
  for (int r = 0; r < 2; ++r) {
    for (int64_t i = 0; i < n; ++i) {
      const float e = ref[rows[r] * n + i];
      EXPECT_NEAR(gguf::Fp16ToFp32(y[r * n + i]), e, std::fabs(e) * 1e-3f + 1e-5f);
    }
  }

  // RoPE: q and k heads of a fused row, positions up to 1000, llama and NeoX
  // pairing, with and without Llama 3.1 frequency factors.
  const int hd = 64, heads = 12;
  const int64_t stride = 15 * hd;
  const std::vector<int32_t> pos = {0, 1, 31, 500, 1000};
  for (bool neox : {false, true}) {
    for (bool factors : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "neox " << neox << " factors " << factors);
      cpu::RopeParams rp;
      rp.head_dim = hd;
      rp.neox = neox;
      if (factors) {
        for (int i = 0; i < hd / 2; ++i) rp.freq_factors.push_back(1.0f + 7.0f * i / (hd / 2));
      }
      auto table = cpu::RopeTable::Create(rp, 1024);
      ASSERT_TRUE(table.ok());
      std::vector<float> cs(1024 * hd);
      RopeCosSinTable(rp, 1024, cs.data());
      std::vector<float> qk = Random(t * stride, 3);
      std::vector<float> dense(t * heads * hd);
      for (int i = 0; i < t; ++i) std::copy_n(&qk[i * stride], heads * hd, &dense[i * heads * hd]);
      ASSERT_TRUE(table->Apply(dense.data(), t, heads, pos).ok());
      DeviceBuffer dqk = Upload(qk), dcs = Upload(cs), dpos = Upload(pos);
      ASSERT_TRUE(
          Rope(dqk.as<float>(), t, stride, heads, hd, neox, dcs.as<float>(), dpos.as<int32_t>(), nullptr)
              .ok());
      const std::vector<float> got = Download<float>(dqk, qk.size());
      for (int i = 0; i < t; ++i) {
        for (int j = 0; j < heads * hd; ++j)
          EXPECT_NEAR(got[i * stride + j], dense[i * heads * hd + j], 1e-5f);
        for (int j = heads * hd; j < stride; ++j)
          EXPECT_EQ(got[i * stride + j], qk[i * stride + j]);  // V untouched
      }
    }
  }

  // Qwen 3's per-head Q norm and Qwen 2's QKV bias on a fused row.
  {
    const std::vector<float> qk = Random(t * stride, 7), hw = Random(hd, 8), bias = Random(stride, 9);
    std::vector<float> ref = qk;
    for (int i = 0; i < t; ++i) {
      cpu::RmsNorm(&ref[i * stride], hw.data(), heads, hd, 1e-6f, &ref[i * stride]);
      for (int64_t j = 0; j < stride; ++j) ref[i * stride + j] += bias[j];
    }
    DeviceBuffer dqk = Upload(qk), dhw = Upload(hw), db = Upload(bias);
    ASSERT_TRUE(HeadRmsNorm(dqk.as<float>(), t, stride, heads, hd, dhw.as<float>(), 1e-6f, nullptr).ok());
    ASSERT_TRUE(AddBias(dqk.as<float>(), t, stride, stride, db.as<float>(), nullptr).ok());
    const std::vector<float> got = Download<float>(dqk, qk.size());
    for (size_t j = 0; j < got.size(); ++j)
      EXPECT_NEAR(got[j], ref[j], std::fabs(ref[j]) * 1e-5f + 1e-5f) << j;
  }

  // SwiGLU on a fused gate|up row.
  const int64_t ff = 1536;
  const std::vector<float> gu = Random(t * 2 * ff, 4, 6.0f);
  std::vector<float> sref(t * ff);
  for (int i = 0; i < t; ++i) cpu::SwiGlu(&gu[i * 2 * ff], &gu[i * 2 * ff + ff], ff, &sref[i * ff]);
  DeviceBuffer dgu = Upload(gu), dh = std::move(DeviceBuffer::Allocate(t * ff * 2, "t")).value();
  ASSERT_TRUE(SwiGluToF16(dgu.as<float>(), t, ff, dh.as<uint16_t>(), nullptr).ok());
  const std::vector<uint16_t> h = Download<uint16_t>(dh, t * ff);
  for (int64_t i = 0; i < t * ff; ++i) {
    EXPECT_NEAR(gguf::Fp16ToFp32(h[i]), sref[i], std::fabs(sref[i]) * 1e-3f + 1e-5f) << i;
  }
}

// Every type the device keeps weights in: MatVec for 1..8 tokens (with beta 0
// and 1, into a wider output), DequantizeRowsToF16 of a row range, and
// EmbeddingLookup, all against the host decoder.
TEST(CudaKernelsTest, WeightKernelsMatchHostDecoderForEveryType) {
  KVCACHE_REQUIRE_GPU();
  using gguf::GgmlType;
  const int64_t rows = 37, cols = 512, ldy = 45;  // rows not a multiple of the 4 rows a block
  for (GgmlType type :
       {GgmlType::kF32, GgmlType::kF16, GgmlType::kBF16, GgmlType::kQ4_0, GgmlType::kQ4_1, GgmlType::kQ5_0,
        GgmlType::kQ5_1, GgmlType::kQ8_0, GgmlType::kQ4_K, GgmlType::kQ5_K, GgmlType::kQ6_K}) {
    SCOPED_TRACE(gguf::TypeName(type));
    const int64_t row_bytes = *gguf::RowBytes(type, cols);
    const std::vector<float> src = Random(rows * cols, 11, 0.5f);
    std::vector<uint8_t> q(rows * row_bytes);
    std::vector<float> w(rows * cols);
    for (int64_t r = 0; r < rows; ++r) {
      ASSERT_TRUE(gguf::QuantizeRow(type, &src[r * cols], &q[r * row_bytes], cols).ok());
      ASSERT_TRUE(gguf::DequantizeRow(type, &q[r * row_bytes], &w[r * cols], cols).ok());
    }
    DeviceBuffer dq = Upload(q);
    const DeviceWeight dw{type, rows, cols, row_bytes, dq.as<uint8_t>()};

    for (int n_tokens : {1, 2, 3, 5, 8}) {
      std::vector<uint16_t> x16(n_tokens * cols);
      std::vector<float> x(n_tokens * cols);
      const std::vector<float> xr = Random(n_tokens * cols, 12 + n_tokens);
      for (size_t i = 0; i < x.size(); ++i) {
        x16[i] = gguf::Fp32ToFp16(xr[i]);
        x[i] = gguf::Fp16ToFp32(x16[i]);
      }
      const std::vector<float> y0 = Random(n_tokens * ldy, 13);
      DeviceBuffer dx = Upload(x16);
      for (float beta : {0.0f, 1.0f}) {
        DeviceBuffer dy = Upload(y0);
        ASSERT_TRUE(MatVec(dw, dx.as<uint16_t>(), n_tokens, dy.as<float>() + 3, ldy, beta, nullptr).ok());
        const std::vector<float> y = Download<float>(dy, y0.size());
        for (int t = 0; t < n_tokens; ++t) {
          for (int64_t i = 0; i < ldy; ++i) {
            const int64_t r = i - 3;
            if (r < 0 || r >= rows) {  // outside the product: untouched
              EXPECT_EQ(y[t * ldy + i], y0[t * ldy + i]) << "t " << t << " i " << i;
              continue;
            }
            double want = beta * y0[t * ldy + i], mag = std::fabs(want);
            for (int64_t c = 0; c < cols; ++c) {
              want += static_cast<double>(w[r * cols + c]) * x[t * cols + c];
              mag += std::fabs(static_cast<double>(w[r * cols + c]) * x[t * cols + c]);
            }
            EXPECT_NEAR(y[t * ldy + i], want, 1e-5 * mag + 1e-6)
                << n_tokens << " tokens, beta " << beta << ", token " << t << " row " << r;
          }
        }
      }
    }
    EXPECT_EQ(MatVec(dw, dq.as<uint16_t>(), 9, nullptr, ldy, 0.0f, nullptr).code(),
              absl::StatusCode::kInvalidArgument);

    // Rows [5, 5 + 30) to f16.
    DeviceBuffer d16 = std::move(DeviceBuffer::Allocate(30 * cols * 2, "t")).value();
    ASSERT_TRUE(DequantizeRowsToF16(dw, 5, 30, d16.as<uint16_t>(), nullptr).ok());
    const std::vector<uint16_t> h = Download<uint16_t>(d16, 30 * cols);
    for (int64_t i = 0; i < 30 * cols; ++i) {
      const float want = w[5 * cols + i];
      ASSERT_NEAR(gguf::Fp16ToFp32(h[i]), want, std::fabs(want) * 1e-3f + 1e-6f) << i;
    }
    EXPECT_EQ(DequantizeRowsToF16(dw, 10, 30, d16.as<uint16_t>(), nullptr).code(),
              absl::StatusCode::kInvalidArgument);

    // Token rows 36, 0, 17, 36.
    const std::vector<int32_t> ids = {36, 0, 17, 36};
    DeviceBuffer dids = Upload(ids);
    DeviceBuffer de = std::move(DeviceBuffer::Allocate(ids.size() * cols * 4, "t")).value();
    ASSERT_TRUE(
        EmbeddingLookup(dw, dids.as<int32_t>(), static_cast<int>(ids.size()), de.as<float>(), nullptr).ok());
    const std::vector<float> e = Download<float>(de, ids.size() * cols);
    for (size_t t = 0; t < ids.size(); ++t) {
      for (int64_t c = 0; c < cols; ++c) {  // the device may fuse d * q + m into one FMA
        ASSERT_NEAR(e[t * cols + c], w[ids[t] * cols + c], 1e-6f) << t << " " << c;
      }
    }
  }
  EXPECT_EQ(WeightKernelsSupport(gguf::GgmlType::kQ2_K, 256).code(), absl::StatusCode::kUnimplemented);
  EXPECT_EQ(WeightKernelsSupport(gguf::GgmlType::kF16, 20).code(), absl::StatusCode::kUnimplemented);
}

}  // namespace
}  // namespace kvcache::cuda
