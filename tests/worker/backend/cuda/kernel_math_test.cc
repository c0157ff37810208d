// The CUDA backend's shared KV_HD math (worker/backend/cuda/kernel_math.h), run on
// the CPU and checked against the CPU backend: the same helpers run inside the
// kernels, so this pins the GPU math without a GPU.
#include "worker/backend/cuda/kernel_math.h"

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "worker/backend/cpu/attention.h"
#include "worker/backend/cpu/ops.h"
#include "worker/kv/kv_shape.h"

namespace kvcache::cuda {
namespace {

std::vector<float> Random(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-scale, scale);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng);
  return v;
}

TEST(KernelMathTest, SwiGluMatchesCpu) {
  const std::vector<float> g = Random(1000, 1, 8.0f), u = Random(1000, 2, 3.0f);
  std::vector<float> cpu_out(1000);
  cpu::SwiGlu(g.data(), u.data(), 1000, cpu_out.data());
  for (int i = 0; i < 1000; ++i) {
    EXPECT_NEAR(SwiGluValue(g[i], u[i]), cpu_out[i], 1e-5f * (1.0f + std::fabs(cpu_out[i]))) << i;
  }
}

TEST(KernelMathTest, RmsNormMatchesCpu) {
  const int64_t n = 576;
  const std::vector<float> x = Random(3 * n, 3, 2.0f), w = Random(n, 4);
  std::vector<float> cpu_out(3 * n);
  cpu::RmsNorm(x.data(), w.data(), 3, n, 1e-5f, cpu_out.data());
  for (int t = 0; t < 3; ++t) {
    float ss = 0.0f;
    for (int64_t i = 0; i < n; ++i) ss += x[t * n + i] * x[t * n + i];
    const float scale = RmsScale(ss, n, 1e-5f);
    for (int64_t i = 0; i < n; ++i) {
      EXPECT_NEAR(x[t * n + i] * scale * w[i], cpu_out[t * n + i], 1e-5f) << t << "," << i;
    }
  }
}

TEST(KernelMathTest, RopeMatchesCpuTable) {
  const int hd = 64, max_pos = 300;
  cpu::RopeParams rp;
  rp.head_dim = hd;
  rp.freq_base = 100000.0f;
  rp.freq_scale = 0.5f;
  auto table = cpu::RopeTable::Create(rp, max_pos);
  ASSERT_TRUE(table.ok()) << table.status();
  for (int p : {0, 1, 17, 299}) {
    for (int i = 0; i < hd / 2; ++i) {
      const model::RopeAngle a = model::RopeAt(rp, p, i);
      // Bit-exact: the model's angle in double, rounded to f32 once, in slots 2i and 2i + 1.
      EXPECT_EQ(static_cast<float>(a.cos), table->cos_row(p)[2 * i]);
      EXPECT_EQ(static_cast<float>(a.cos), table->cos_row(p)[2 * i + 1]);
      EXPECT_EQ(static_cast<float>(-a.sin), table->sin_row(p)[2 * i]);
      EXPECT_EQ(static_cast<float>(a.sin), table->sin_row(p)[2 * i + 1]);
    }
  }
  // NeoX pairing: slots i and i + head_dim/2.
  cpu::RopeParams np = rp;
  np.neox = true;
  for (int i = 0; i < hd / 2; ++i) np.freq_factors.push_back(1.0f + 0.25f * i);
  auto neox = cpu::RopeTable::Create(np, max_pos);
  ASSERT_TRUE(neox.ok()) << neox.status();
  for (int p : {0, 3, 299}) {
    for (int i = 0; i < hd / 2; ++i) {
      const model::RopeAngle a = model::RopeAt(np, p, i);
      EXPECT_EQ(static_cast<float>(a.cos), neox->cos_row(p)[i]);
      EXPECT_EQ(static_cast<float>(a.cos), neox->cos_row(p)[i + hd / 2]);
      EXPECT_EQ(static_cast<float>(-a.sin), neox->sin_row(p)[i]);
      EXPECT_EQ(static_cast<float>(a.sin), neox->sin_row(p)[i + hd / 2]);
    }
  }
  // The rotation itself, on two heads of three tokens.
  const std::vector<int32_t> pos = {0, 5, 299};
  std::vector<float> x = Random(3 * 2 * hd, 5), ref = x;
  ASSERT_TRUE(table->Apply(ref.data(), 3, 2, pos).ok());
  for (int t = 0; t < 3; ++t) {
    for (int h = 0; h < 2; ++h) {
      for (int i = 0; i < hd / 2; ++i) {
        const model::RopeAngle a = model::RopeAt(rp, pos[t], i);
        float* p = &x[(t * 2 + h) * hd + 2 * i];
        RopeRotate(p, p + 1, static_cast<float>(a.cos), static_cast<float>(a.sin));
        EXPECT_NEAR(p[0], ref[(t * 2 + h) * hd + 2 * i], 1e-6f);
        EXPECT_NEAR(p[1], ref[(t * 2 + h) * hd + 2 * i + 1], 1e-6f);
      }
    }
  }
}

kv::PageLayout Layout(kv::KvDtype dtype) {
  kv::PageLayout L;
  L.layers = 3;
  L.kv_heads = 2;
  L.head_dim = 32;
  L.page_tokens = 16;
  L.dtype = dtype;
  return L;
}

TEST(KernelMathTest, KvAddressingAndEncodingMatchCpuWriteKv) {
  for (kv::KvDtype dtype : {kv::KvDtype::kF16, kv::KvDtype::kBF16}) {
    const kv::PageLayout L = Layout(dtype);
    kv::KvShape shape{L.layers, L.kv_heads, L.head_dim, static_cast<kv::KvDtype>(dtype), L.page_tokens, 0};
    ASSERT_EQ(shape.page_bytes(), L.page_bytes());
    const std::vector<int32_t> table = {4, 1, 3};
    std::vector<uint8_t> slab(5 * L.page_bytes());
    const int n = 40, layer = 2;
    const std::vector<float> k = Random(n * L.row_elems(), 6, 4.0f), v = Random(n * L.row_elems(), 7, 4.0f);
    ASSERT_TRUE(cpu::WriteKv(L, slab.data(), table, layer, 0, n, k.data(), v.data()).ok());
    const bool bf16 = dtype == kv::KvDtype::kBF16;
    for (int pos = 0; pos < n; ++pos) {
      for (int h = 0; h < L.kv_heads; ++h) {
        const int64_t ko = KvRowOffset(L, table.data(), layer, pos, h, false);
        const int64_t vo = KvRowOffset(L, table.data(), layer, pos, h, true);
        EXPECT_EQ(
            ko, table[pos / 16] * L.page_bytes() + kv::KOffset(shape, layer, pos % 16) + h * L.head_dim * 2);
        EXPECT_EQ(
            vo, table[pos / 16] * L.page_bytes() + kv::VOffset(shape, layer, pos % 16) + h * L.head_dim * 2);
        for (int d = 0; d < L.head_dim; ++d) {
          uint16_t kb, vb;
          std::memcpy(&kb, slab.data() + ko + 2 * d, 2);
          std::memcpy(&vb, slab.data() + vo + 2 * d, 2);
          const int64_t at = pos * L.row_elems() + h * L.head_dim + d;
          EXPECT_EQ(KvEncode(k[at], bf16), kb);
          EXPECT_EQ(KvEncode(v[at], bf16), vb);
        }
      }
    }
  }
}

// Attention assembled the way the GPU does it (256-key splits, each an exact
// softmax partial, merged with MergeSoftmaxPartial) equals the CPU kernel.
TEST(KernelMathTest, SplitSoftmaxAttentionMatchesCpu) {
  for (int window : {0, 300}) {
    SCOPED_TRACE(window);
    const kv::PageLayout L = Layout(kv::KvDtype::kF16);
    const int n_heads = 6, group = n_heads / L.kv_heads, n = 700, layer = 1;
    const int pages = (n + 15) / 16;
    std::vector<int32_t> table(pages);
    for (int i = 0; i < pages; ++i) table[i] = pages - 1 - i;
    std::vector<uint8_t> slab(pages * L.page_bytes());
    const std::vector<float> k = Random(n * L.row_elems(), 8), v = Random(n * L.row_elems(), 9);
    ASSERT_TRUE(cpu::WriteKv(L, slab.data(), table, layer, 0, n, k.data(), v.data()).ok());
    const int n_query = 3;  // the last three positions, causal
    const std::vector<float> q = Random(n_query * n_heads * L.head_dim, 10);
    std::vector<float> ref(q.size());
    cpu::AttentionParams ap;
    ap.layout = L;
    ap.kv_base = slab.data();
    ap.layer = layer;
    ap.n_heads = n_heads;
    ap.sliding_window = window;
    const cpu::AttentionSeq seq{table, n, n_query};
    ASSERT_TRUE(cpu::PagedAttention(ap, {&seq, 1}, q.data(), ref.data()).ok());

    const float scale = 1.0f / std::sqrt(static_cast<float>(L.head_dim));
    for (int qi = 0; qi < n_query; ++qi) {
      const int pos = n - n_query + qi;
      const int first = FirstVisibleKey(pos, window);
      EXPECT_EQ(AttentionSplits(pos, window),
                (pos + 1 - first + kAttentionSplitTokens - 1) / kAttentionSplitTokens);
      for (int h = 0; h < n_heads; ++h) {
        const float* qh = &q[(qi * n_heads + h) * L.head_dim];
        SoftmaxPartial total;
        std::vector<float> out(L.head_dim, 0.0f);
        for (int s0 = first; s0 <= pos; s0 += kAttentionSplitTokens) {
          const int s1 = std::min(pos + 1, s0 + kAttentionSplitTokens);
          std::vector<float> score(s1 - s0);
          SoftmaxPartial part;
          for (int j = s0; j < s1; ++j) {
            const uint8_t* kr = slab.data() + KvRowOffset(L, table.data(), layer, j, h / group, false);
            float dot = 0.0f;
            for (int d = 0; d < L.head_dim; ++d) {
              uint16_t b;
              std::memcpy(&b, kr + 2 * d, 2);
              dot += KvDecode(b, false) * qh[d] * scale;
            }
            score[j - s0] = dot;
            part.m = std::max(part.m, dot);
          }
          std::vector<float> o(L.head_dim, 0.0f);
          for (int j = s0; j < s1; ++j) {
            const float p = std::exp(score[j - s0] - part.m);
            part.l += p;
            const uint8_t* vr = slab.data() + KvRowOffset(L, table.data(), layer, j, h / group, true);
            for (int d = 0; d < L.head_dim; ++d) {
              uint16_t b;
              std::memcpy(&b, vr + 2 * d, 2);
              o[d] += p * KvDecode(b, false);
            }
          }
          MergeSoftmaxPartial(&total, out.data(), part, o.data(), L.head_dim);
        }
        for (int d = 0; d < L.head_dim; ++d) {
          EXPECT_NEAR(out[d] / total.l, ref[(qi * n_heads + h) * L.head_dim + d], 2e-5f)
              << qi << "," << h << "," << d;
        }
      }
    }
  }
}

}  // namespace
}  // namespace kvcache::cuda
