// Micro-benchmark of the CPU kernels on SmolLM2-135M shapes.
//
//   matvec_*:   weight GB/s of MatMul at batch 1/4/16 (weights cycled through copies
//               of twice the L3, so this is the decode-time DRAM stream)
//   types_*:    decode matvec (1 token) of every integer-dot weight type (q4_0, q5_0,
//               q8_0, q4_1, q4_k, q5_k, q6_k) at each vector kernel level: weight
//               GB/s, its fraction of the measured read bandwidth, and the speed-up
//               over the dequantise path those types took before their integer
//               kernels (DequantizeRow to f32 per 16-row chunk, then an f32 dot)
//   decode_*:   every linear layer of one SmolLM2 decode step (30 layers + tied
//               output; ~96 MB of Q4_1/Q8_0), batch 1 and 16, as the runner holds
//               them (InterleaveRows16), against the stored layout (baseline)
//   prefill_*:  GFLOP/s at 256 tokens, integer kernel and dequant+sgemm, against a
//               baseline of OpenBLAS sgemm on pre-dequantised f32 weights (same run)
//   prefill_types_*: integer kernel vs dequant+sgemm GFLOP/s of every integer-dot
//               type at each vector level, 16 to 256 tokens (where kAuto should
//               switch routes)
//   attention_: decode over 4096 cached tokens (f16 KV), K/V bytes read per second
//               divided by this machine's read bandwidth measured in the same run.
#include <cblas.h>
#include <immintrin.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "common/bench_json.h"
#include "common/gguf/fp16.h"
#include "common/gguf/ggml_types.h"
#include "tests/bench/mem_bandwidth.h"
#include "worker/backend/cpu/attention.h"
#include "worker/backend/cpu/compute_pool.h"
#include "worker/backend/cpu/cpu_features.h"
#include "worker/backend/cpu/matmul.h"

ABSL_FLAG(std::string, sections, "bw,matvec,types,decode,prefill,prefilltypes,attention",
          "comma-separated parts to run (bw is always measured)");
ABSL_FLAG(int, kernel_level, -1, "force a CpuKernelLevel (0 scalar, 1 avx2, 2 avx512); -1 = best");

namespace kvcache::cpu {
namespace {

using gguf::GgmlType;
using Clock = std::chrono::steady_clock;

// Seconds per call of fn in the fastest of `reps` timed batches of calls that each
// last at least `min_batch_s`.
double TimeIt(const std::function<void()>& fn, double min_batch_s = 0.05, int reps = 5) {
  fn();  // warm-up
  std::vector<double> per_call;
  for (int r = 0; r < reps; ++r) {
    int calls = 0;
    const auto start = Clock::now();
    double elapsed = 0;
    do {
      fn();
      ++calls;
      elapsed = std::chrono::duration<double>(Clock::now() - start).count();
    } while (elapsed < min_batch_s);
    per_call.push_back(elapsed / calls);
  }
  // The best batch: the cores are shared, and slower batches measure the neighbours.
  return *std::min_element(per_call.begin(), per_call.end());
}

// Random but valid blocks: f16 scales of sane magnitude, random quants (and random
// k-quant sub-block scales and mins).
// Bytes of weight copies that a memory-stream measurement cycles through: twice
// the L3 (sysconf, else sysfs), at least 128 MiB, so that each call finds its
// matrix in DRAM and not in a cache that kept it since its last turn (VMs here
// reported 260-480 MiB of L3, which 128 MiB of copies fit).
int64_t StreamBytes() {
  int64_t l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
  if (l3 <= 0) {
    std::ifstream in("/sys/devices/system/cpu/cpu0/cache/index3/size");
    std::string size;
    if (in >> size && !size.empty()) {
      l3 = std::atoll(size.c_str());
      if (size.back() == 'K') l3 <<= 10;
      if (size.back() == 'M') l3 <<= 20;
    }
  }
  return std::max<int64_t>(int64_t{128} << 20, 2 * l3);
}

std::vector<uint8_t> RandomWeights(GgmlType type, int64_t rows, int64_t cols, uint64_t seed) {
  const int64_t row_bytes = *gguf::RowBytes(type, cols);
  std::vector<uint8_t> bytes(static_cast<size_t>(rows * row_bytes));
  std::mt19937_64 rng(seed);
  for (size_t i = 0; i + 8 <= bytes.size(); i += 8) {
    const uint64_t v = rng();
    std::memcpy(&bytes[i], &v, 8);
  }
  const int64_t block = gguf::TypeTraits(type).type_size;
  const uint16_t d = gguf::Fp32ToFp16(0.01f), m = gguf::Fp32ToFp16(-0.08f);
  for (size_t off = 0; off + block <= bytes.size(); off += block) {
    if (type == GgmlType::kQ6_K) {  // d is Q6_K's last field
      std::memcpy(&bytes[off + offsetof(gguf::BlockQ6_K, d)], &d, 2);
      continue;
    }
    std::memcpy(&bytes[off], &d, 2);  // d first in every other block
    if (type == GgmlType::kQ4_1 || type == GgmlType::kQ4_K || type == GgmlType::kQ5_K) {
      std::memcpy(&bytes[off + 2], &m, 2);  // then m / dmin
    }
  }
  return bytes;
}

__attribute__((target("avx2,fma"))) float DotF32Avx2(const float* a, const float* b, int64_t n) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_add_ps(acc0, acc1));
  float sum = 0;
  for (float v : lanes) sum += v;
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// The route every quantised type but Q4_1/Q8_0 took before it had an integer kernel:
// chunks of 16 rows DequantizeRow()d to f32 (per thread), then an AVX2 f32 dot
// (the library's f32 kernel at one token is the same FMA loop). Rows split over
// `threads` ComputePool threads, as MatMul does. REQUIRES: AVX2 + FMA.
void DequantMatVec(const WeightView& w, const float* x, float* y, int threads) {
  constexpr int64_t kChunk = 16;
  const int64_t row_bytes = *gguf::RowBytes(w.type, w.cols);
  const int64_t n_chunks = (w.rows + kChunk - 1) / kChunk;
  const auto* bytes = static_cast<const uint8_t*>(w.data);
  ComputePool::Get().ParallelFor(n_chunks, threads, [&](int64_t c) {
    thread_local std::vector<float> buf;
    buf.resize(static_cast<size_t>(kChunk * w.cols));
    const int64_t r0 = c * kChunk, nr = std::min(kChunk, w.rows - r0);
    for (int64_t r = 0; r < nr; ++r) {
      (void)gguf::DequantizeRow(w.type, bytes + (r0 + r) * row_bytes, buf.data() + r * w.cols, w.cols);
    }
    for (int64_t r = 0; r < nr; ++r) y[r0 + r] = DotF32Avx2(buf.data() + r * w.cols, x, w.cols);
  });
}

// A matrix as the CPU runner holds it: the stored bytes and, where the type has
// one, the InterleaveRows16 layout that every step reads.
struct Linear {
  Linear(GgmlType t, int64_t r, int64_t c, std::vector<uint8_t> b)
      : type(t), rows(r), cols(c), bytes(std::move(b)), inter(InterleaveRows16(stored())) {}
  GgmlType type;
  int64_t rows, cols;
  std::vector<uint8_t> bytes;
  std::vector<uint8_t> inter;
  WeightView stored() const { return {type, bytes.data(), rows, cols}; }
  KernelWeight view() const {
    return inter.empty() ? KernelWeight(stored()) : KernelWeight(stored(), inter.data());
  }
};

}  // namespace
}  // namespace kvcache::cpu

int main(int argc, char** argv) {
  using namespace kvcache::cpu;  // NOLINT
  absl::ParseCommandLine(argc, argv);
  kvcache::bench::BenchReport report;
  report.benchmark = "cpu_kernels";
  if (absl::GetFlag(FLAGS_kernel_level) >= 0 &&
      !SetCpuKernelLevel(static_cast<CpuKernelLevel>(absl::GetFlag(FLAGS_kernel_level))).ok()) {
    return 1;
  }
  const int threads = NumThreads();
  report.metrics["threads"] = threads;
  report.notes["kernel_level"] = CpuKernelLevelName(GetCpuKernelLevel());

  const std::string sections = absl::GetFlag(FLAGS_sections);
  auto want = [&](const char* name) { return sections.find(name) != std::string::npos; };
  const double bw = kvcache::bench::MeasureReadBandwidth(threads);
  report.metrics["mem_read_bw_gb_per_s"] = bw / 1e9;

  // ---- matvec GB/s at batch 1/4/16 (SmolLM2 shapes), weights cycled through
  // StreamBytes() of copies.
  const int64_t stream_bytes = StreamBytes();
  report.metrics["weight_copies_mib"] = static_cast<double>(stream_bytes >> 20);
  struct Shape {
    const char* name;
    GgmlType type;
    int64_t rows, cols;
  };
  const Shape shapes[] = {{"q4_1_576x1536", GgmlType::kQ4_1, 1536, 576},
                          {"q4_1_1536x576", GgmlType::kQ4_1, 576, 1536},
                          {"q8_0_576x49152", GgmlType::kQ8_0, 49152, 576}};
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> x(256 * 1536), y(256 * 49152);
  for (float& v : x) v = dist(rng);
  for (const Shape& s : shapes) {
    if (!want("matvec")) break;
    const int64_t bytes = s.rows * *kvcache::gguf::RowBytes(s.type, s.cols);
    const int copies = static_cast<int>(std::max<int64_t>(1, stream_bytes / bytes));
    std::vector<Linear> ws;
    for (int c = 0; c < copies; ++c)
      ws.emplace_back(s.type, s.rows, s.cols, RandomWeights(s.type, s.rows, s.cols, c));
    for (int batch : {1, 4, 16}) {
      int next = 0;
      const double t = TimeIt([&] {
        const KernelWeight w = ws[next].view();
        next = (next + 1) % copies;
        (void)MatMul(w, x.data(), batch, y.data());
      });
      report.metrics[absl::StrCat("matvec_", s.name, "_b", batch, "_gb_per_s")] = bytes / t / 1e9;
    }
  }

  // ---- decode matvec (1 token) of each integer-dot type at each vector level.
  // Shapes named in x out: SmolLM2's up (576x1536) and down (1536x576) projections,
  // and 4096x4096 (a 7-8B model's attention projection, far larger than the caches).
  // K-quants need in % 256 == 0, so they skip 576x1536. Weights cycled through
  // StreamBytes() of copies, as in matvec_* above.
  if (want("types")) {
    const CpuKernelLevel saved = GetCpuKernelLevel();
    const GgmlType types[] = {GgmlType::kQ4_0, GgmlType::kQ5_0, GgmlType::kQ8_0, GgmlType::kQ4_1,
                              GgmlType::kQ4_K, GgmlType::kQ5_K, GgmlType::kQ6_K};
    const int64_t dims[][2] = {{576, 1536}, {1536, 576}, {4096, 4096}};  // {in, out}
    std::vector<float> xt(4096), yt(4096);
    for (float& v : xt) v = dist(rng);
    for (GgmlType type : types) {
      for (const auto& dim : dims) {
        const int64_t cols = dim[0], rows = dim[1];
        if (cols % kvcache::gguf::TypeTraits(type).block_size != 0) continue;
        const int64_t bytes = rows * *kvcache::gguf::RowBytes(type, cols);
        const int copies = static_cast<int>(std::max<int64_t>(1, stream_bytes / bytes));
        std::vector<Linear> ws;
        for (int c = 0; c < copies; ++c)
          ws.emplace_back(type, rows, cols, RandomWeights(type, rows, cols, 100 + c));
        int next = 0;
        auto view = [&] {
          const KernelWeight w = ws[next].view();
          next = (next + 1) % copies;
          return w;
        };
        const std::string key =
            absl::StrCat("types_", kvcache::gguf::TypeName(type), "_", cols, "x", rows, "_b1");
        // The dequantise path does not depend on the kernel level beyond its f32 dot;
        // it is measured at the machine's best level.
        const double t_deq = TimeIt([&] { DequantMatVec(view().view, xt.data(), yt.data(), threads); });
        report.baseline[key + "_dequant_gb_per_s"] = bytes / t_deq / 1e9;
        for (CpuKernelLevel level : SupportedCpuKernelLevels()) {
          if (level == CpuKernelLevel::kScalar) continue;
          if (!SetCpuKernelLevel(level).ok()) continue;
          const double t = TimeIt([&] { (void)MatMul(view(), xt.data(), 1, yt.data()); });
          const std::string lk = absl::StrCat(key, "_", CpuKernelLevelName(level));
          report.metrics[lk + "_gb_per_s"] = bytes / t / 1e9;
          report.ratio[lk + "_bw_fraction"] = bytes / t / bw;
          report.ratio[lk + "_vs_dequant"] = t_deq / t;
        }
        (void)SetCpuKernelLevel(saved);
      }
    }
  }

  // ---- every linear layer of a SmolLM2-135M decode step (30 layers + tied Q8_0 output).
  std::vector<Linear> model;
  for (int l = 0; l < 30 && want("decode"); ++l) {
    const int64_t shapes_l[7][2] = {{576, 576},  {192, 576},  {192, 576}, {576, 576},
                                    {1536, 576}, {1536, 576}, {576, 1536}};
    for (const auto& rc : shapes_l) {
      model.push_back(
          {GgmlType::kQ4_1, rc[0], rc[1], RandomWeights(GgmlType::kQ4_1, rc[0], rc[1], l * 7 + rc[0])});
    }
  }
  model.push_back({GgmlType::kQ8_0, 49152, 576, RandomWeights(GgmlType::kQ8_0, 49152, 576, 999)});
  double model_bytes = 0;
  for (const Linear& lin : model) model_bytes += static_cast<double>(lin.bytes.size());
  report.metrics["decode_weights_mb"] = model_bytes / 1e6;
  double step_b1 = 0;
  for (int batch : {1, 16}) {
    if (!want("decode")) break;
    const double t = TimeIt(
        [&] {
          for (const Linear& lin : model) (void)MatMul(lin.view(), x.data(), batch, y.data());
        },
        0.3, 5);
    if (batch == 1) step_b1 = t;
    report.metrics[absl::StrCat("decode_matmuls_b", batch, "_ms")] = t * 1e3;
    report.metrics[absl::StrCat("decode_matmuls_b", batch, "_tokens_per_s")] = batch / t;
    report.metrics[absl::StrCat("decode_matmuls_b", batch, "_weight_gb_per_s")] = model_bytes / t / 1e9;
    if (batch == 16) report.ratio["decode_matmuls_b16_vs_b1_throughput"] = 16 * step_b1 / t;
    // The same products on the stored layout (each call re-lays its groups).
    const double t_stored = TimeIt(
        [&] {
          for (const Linear& lin : model) (void)MatMul(lin.stored(), x.data(), batch, y.data());
        },
        0.3, 5);
    report.baseline[absl::StrCat("decode_matmuls_b", batch, "_stored_layout_ms")] = t_stored * 1e3;
    report.ratio[absl::StrCat("decode_matmuls_b", batch, "_interleaved_vs_stored")] = t_stored / t;
  }
  if (want("decode")) report.ratio["decode_matmuls_b1_weight_bw_fraction"] = model_bytes / step_b1 / bw;

  // ---- prefill GEMM at 256 tokens vs dequantised-f32 OpenBLAS sgemm.
  for (const Shape& s : {shapes[0], shapes[1]}) {
    if (!want("prefill")) break;
    const Linear lin{s.type, s.rows, s.cols, RandomWeights(s.type, s.rows, s.cols, 5)};
    std::vector<float> wf(static_cast<size_t>(s.rows * s.cols));
    const int64_t rb = *kvcache::gguf::RowBytes(s.type, s.cols);
    for (int64_t r = 0; r < s.rows; ++r) {
      (void)kvcache::gguf::DequantizeRow(s.type, lin.bytes.data() + r * rb, wf.data() + r * s.cols, s.cols);
    }
    const int n = 256;
    const double flops = 2.0 * n * s.rows * s.cols;
    const double t_dot =
        TimeIt([&] { (void)MatMul(lin.view(), x.data(), s.cols, n, y.data(), s.rows, MatMulPath::kDot); });
    const double t_sg =
        TimeIt([&] { (void)MatMul(lin.view(), x.data(), s.cols, n, y.data(), s.rows, MatMulPath::kSgemm); });
    openblas_set_num_threads(threads);
    const double t_base = TimeIt([&] {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, static_cast<int>(s.rows),
                  static_cast<int>(s.cols), 1.0f, x.data(), static_cast<int>(s.cols), wf.data(),
                  static_cast<int>(s.cols), 0.0f, y.data(), static_cast<int>(s.rows));
    });
    const std::string key = absl::StrCat("prefill256_", s.name);
    report.metrics[key + "_dot_gflop_per_s"] = flops / t_dot / 1e9;
    report.metrics[key + "_sgemm_path_gflop_per_s"] = flops / t_sg / 1e9;
    report.metrics[key + "_auto_gflop_per_s"] =
        flops / TimeIt([&] { (void)MatMul(lin.view(), x.data(), n, y.data()); }) / 1e9;
    report.baseline[key + "_openblas_f32_gflop_per_s"] = flops / t_base / 1e9;
    report.ratio[key + "_best_vs_openblas_f32"] = t_base / std::min(t_dot, t_sg);
    // Crossover between the integer kernel and dequant+sgemm.
    if (s.rows == 1536) {
      for (int nt : {8, 16, 32, 64, 128}) {
        const double a = TimeIt(
            [&] { (void)MatMul(lin.view(), x.data(), s.cols, nt, y.data(), s.rows, MatMulPath::kDot); }, 0.02,
            3);
        const double b = TimeIt(
            [&] { (void)MatMul(lin.view(), x.data(), s.cols, nt, y.data(), s.rows, MatMulPath::kSgemm); },
            0.02, 3);
        report.metrics[absl::StrCat("crossover_", s.name, "_n", nt, "_sgemm_over_dot_time")] = b / a;
      }
    }
  }

  // ---- prefill route of each integer-dot type at each vector level: the
  // integer kernel against dequant+sgemm on SmolLM2's down projection (1536 in,
  // 576 out; every type's blocks divide 1536), at 256 tokens and at the smaller
  // counts where the cheaper route may change.
  if (want("prefilltypes")) {
    const CpuKernelLevel saved = GetCpuKernelLevel();
    const int64_t rows = 576, cols = 1536;
    for (GgmlType type : {GgmlType::kQ4_0, GgmlType::kQ5_0, GgmlType::kQ8_0, GgmlType::kQ4_1, GgmlType::kQ4_K,
                          GgmlType::kQ5_K, GgmlType::kQ6_K}) {
      const Linear lin{type, rows, cols, RandomWeights(type, rows, cols, 11)};
      for (CpuKernelLevel level : SupportedCpuKernelLevels()) {
        if (level == CpuKernelLevel::kScalar || !SetCpuKernelLevel(level).ok()) continue;
        for (int n : {16, 32, 64, 128, 256}) {
          const double flops = 2.0 * n * rows * cols;
          const double t_dot =
              TimeIt([&] { (void)MatMul(lin.view(), x.data(), cols, n, y.data(), rows, MatMulPath::kDot); },
                     0.02, 3);
          const double t_sg =
              TimeIt([&] { (void)MatMul(lin.view(), x.data(), cols, n, y.data(), rows, MatMulPath::kSgemm); },
                     0.02, 3);
          const std::string key = absl::StrCat("prefill_types_", kvcache::gguf::TypeName(type), "_", cols,
                                               "x", rows, "_n", n, "_", CpuKernelLevelName(level));
          report.metrics[key + "_dot_gflop_per_s"] = flops / t_dot / 1e9;
          report.metrics[key + "_sgemm_gflop_per_s"] = flops / t_sg / 1e9;
          report.ratio[key + "_dot_over_sgemm_speed"] = t_sg / t_dot;
        }
      }
      (void)SetCpuKernelLevel(saved);
    }
  }

  // ---- decode attention over 4096 cached tokens, SmolLM2 shape, f16 KV.
  if (want("attention")) {
    const int sessions = 32, ctx = 4096, n_heads = 9;
    // 2 layers per page (the model has 30): the benchmark reads layer 1, so every page
    // interleaves unread bytes the way real pages do, in 12 KiB runs.
    const PageLayout L{2, 3, 64, 16, KvDtype::kF16};
    const int pages_per_seq = ctx / L.page_tokens;
    const int64_t n_pages = int64_t{sessions} * pages_per_seq;
    // 2 MiB-aligned and THP-advised, as a tier-0 slab should be: pages of a session are
    // scattered, and with 4 KiB pages every 4 KiB of K/V would cost a TLB miss.
    const size_t slab_bytes =
        (n_pages * L.page_bytes() + (size_t{2} << 20) - 1) / (size_t{2} << 20) * (size_t{2} << 20);
    uint8_t* slab = static_cast<uint8_t*>(std::aligned_alloc(size_t{2} << 20, slab_bytes));
    if (std::getenv("KV_NO_THP") == nullptr) madvise(slab, slab_bytes, MADV_HUGEPAGE);
    std::vector<std::vector<int32_t>> tables(sessions);
    std::vector<int32_t> ids(n_pages);
    for (int64_t i = 0; i < n_pages; ++i) ids[i] = static_cast<int32_t>(i);
    std::shuffle(ids.begin(), ids.end(), rng);  // pages of a session scattered in the slab
    std::vector<float> kv(static_cast<size_t>(L.row_elems()) * L.page_tokens);
    for (float& v : kv) v = dist(rng);
    for (int s = 0; s < sessions; ++s) {
      tables[s].assign(ids.begin() + s * pages_per_seq, ids.begin() + (s + 1) * pages_per_seq);
      for (int p = 0; p < pages_per_seq; ++p) {
        for (int layer = 0; layer < 2; ++layer) {
          (void)WriteKv(L, slab, tables[s], layer, p * L.page_tokens, L.page_tokens, kv.data(), kv.data());
        }
      }
    }
    std::vector<float> q(static_cast<size_t>(sessions) * n_heads * 64), out(q.size());
    for (float& v : q) v = dist(rng);
    AttentionParams params;
    params.layout = L;
    params.kv_base = slab;
    params.layer = 1;
    params.n_heads = n_heads;
    for (int batch : {sessions, 1}) {
      std::vector<AttentionSeq> seqs;
      for (int s = 0; s < batch; ++s) seqs.push_back({tables[s], ctx, 1});
      // Cycle the starting session so a batch of 1 does not sit in the cache.
      const double t = TimeIt([&] { (void)PagedAttention(params, seqs, q.data(), out.data()); }, 0.3, 5);
      const double bytes = double{1} * batch * ctx * 2 * L.row_bytes();
      const std::string key = absl::StrCat("attention_decode_ctx4096_b", batch);
      report.metrics[key + "_ms"] = t * 1e3;
      report.metrics[key + "_kv_gb_per_s"] = bytes / t / 1e9;
      if (batch == sessions) report.ratio["attention_bw_fraction"] = bytes / t / bw;
    }
    std::free(slab);
  }
  report.baseline["mem_read_bw_gb_per_s"] = bw / 1e9;
  report.notes["baseline"] =
      "mem_read_bw: 512 MiB AVX2 read/sum with the kernel thread count; types_*_dequant: "
      "DequantizeRow per 16-row chunk + f32 dot kernel (the pre-integer route), same threads; "
      "prefill baseline: "
      "cblas_sgemm (OpenBLAS, same threads) on weights dequantised to f32 beforehand";
  report.notes["attention"] = "32 sessions x 4096 tokens, 9 q heads / 3 kv heads x 64, f16 KV";
  return kvcache::bench::Finish(report).ok() ? 0 : 1;
}
