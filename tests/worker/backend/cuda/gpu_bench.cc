// GPU benchmarks, each against a baseline measured in the same run:
//   attention_vs_hbm          decode attention, 64 sessions x 4096 tokens (SmolLM2's
//                             KV shape), bytes of K/V read per second / the bandwidth
//                             of a device-to-device cudaMemcpy (read + write bytes)
//   offload_vs_pinned_memcpy  CudaTierStorage::CopyPages device -> pinned, 360 KiB
//                             pages in shuffled order, in the KV cache manager's
//                             batches (copy_batch_bytes) / one big pinned cudaMemcpyAsync
//   restore_vs_pinned_memcpy  the same, pinned -> device
//   matvec_<type>_vs_hbm      MatVec of one token over a 14336x4096 matrix (Llama 3
//                             8B's FFN shape) in its file encoding: weight bytes
//                             read per second / the d2d copy bandwidth
//   matmul_<type>_t<N>_ms     the same matrix times N = 1, 8, 16, 64 tokens by the
//                             runner's route (MatVec up to kMatVecMaxTokens, else
//                             dequantised slices + cuBLAS), and _dequant_gemm_ms at
//                             N = 8 (the other route at the crossover); baseline:
//                             the f16 matrix by the same route (matmul_f16_t<N>_ms;
//                             ratio matmul_<type>_t<N>_vs_f16)
//   runner_device_bytes       device memory a runner takes (cudaMemGetInfo before
//                             and after CreateRunner), against the model's matrices
//                             in the file (weights_file_bytes) and as f16
//   decode tokens/s at batch 1, 16, 64 of SmolLM2 (the real model when present,
//   else a synthetic Q4_1 model of SmolLM2's shapes with the tiny 323-token vocab),
//   and ttft_cached_history2000_ms: a 20-token turn on a session whose 2,000-token
//   history is cached (tests/gpu/hf_peer.py times transformers recomputing it);
//   each with CUDA graphs (the runner's default) and launch by launch (_eager;
//   ratio decode_graphs_vs_eager_batch<B>)
// Usage: gpu_bench [--json PATH]
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/parse.h"
#include "common/bench_json.h"
#include "common/gguf/ggml_types.h"
#include "common/gguf/gguf_reader.h"
#include "common/gguf/model_path.h"
#include "common/gguf/tiny_llama.h"
#include "worker/backend/cuda/attention.h"
#include "worker/backend/cuda/cuda_backend.h"
#include "worker/backend/cuda/cuda_llama_runner.h"
#include "worker/backend/cuda/cuda_tier_storage.h"
#include "worker/backend/cuda/device_context.h"
#include "worker/backend/cuda/kernel_math.h"
#include "worker/backend/cuda/weight_kernels.h"
#include "worker/kv/kv_cache_manager.h"

extern "C" kvcache::backend::CudaBackendFactory* kvcache_cuda_backend_v1();

namespace kvcache::cuda {
namespace {

#define BENCH_CHECK(expr)                                                    \
  do {                                                                       \
    auto _st = (expr);                                                       \
    if (!IsOk(_st)) {                                                        \
      std::fprintf(stderr, "%s:%d: %s failed\n", __FILE__, __LINE__, #expr); \
      std::exit(1);                                                          \
    }                                                                        \
  } while (0)
bool IsOk(cudaError_t e) { return e == cudaSuccess; }
bool IsOk(const absl::Status& s) {
  if (!s.ok()) std::fprintf(stderr, "%s\n", s.ToString().c_str());
  return s.ok();
}

// Median time in ms of `reps` runs of fn on `stream`, timed with events.
template <typename Fn>
double TimeMs(cudaStream_t stream, int reps, Fn fn) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  fn();  // warm-up
  cudaStreamSynchronize(stream);
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    cudaEventRecord(a, stream);
    fn();
    cudaEventRecord(b, stream);
    cudaEventSynchronize(b);
    float t = 0;
    cudaEventElapsedTime(&t, a, b);
    ms.push_back(t);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

void HbmAndAttention(const DeviceContext& ctx, bench::BenchReport& r) {
  cudaStream_t s = ctx.compute_stream();
  const int64_t copy_bytes = int64_t{2} << 30;
  DeviceBuffer src = std::move(DeviceBuffer::Allocate(copy_bytes, "bench")).value();
  DeviceBuffer dst = std::move(DeviceBuffer::Allocate(copy_bytes, "bench")).value();
  BENCH_CHECK(cudaMemsetAsync(src.get(), 1, copy_bytes, s));
  const double copy_ms =
      TimeMs(s, 10, [&] { cudaMemcpyAsync(dst.get(), src.get(), copy_bytes, cudaMemcpyDeviceToDevice, s); });
  const double hbm = 2.0 * copy_bytes / (copy_ms * 1e-3);
  src.Reset();
  dst.Reset();
  r.baseline["hbm_d2d_copy_GBps"] = hbm / 1e9;

  // 64 sessions x 4096 tokens, SmolLM2 pages (30 layers, 3 kv heads, hd 64, f16).
  const int n_seq = 64, n_tok = 4096, layers = 30;
  kv::PageLayout L;
  L.layers = layers;
  L.kv_heads = 3;
  L.head_dim = 64;
  L.page_tokens = 16;
  L.dtype = kv::KvDtype::kF16;
  const int pages_per_seq = n_tok / 16, n_pages = n_seq * pages_per_seq;
  DeviceBuffer slab =
      std::move(DeviceBuffer::Allocate(int64_t{n_pages} * L.page_bytes(), "bench slab")).value();
  BENCH_CHECK(cudaMemsetAsync(slab.get(), 0x3c, int64_t{n_pages} * L.page_bytes(), s));  // 1.0 in f16 pairs
  std::vector<int32_t> table(n_pages), offsets(n_seq);
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), std::mt19937(1));
  std::vector<AttentionItem> items(n_seq);
  for (int i = 0; i < n_seq; ++i) {
    offsets[i] = i * pages_per_seq;
    items[i] = {i, n_tok - 1};
  }
  auto upload = [&](const void* p, int64_t bytes) {
    DeviceBuffer b = std::move(DeviceBuffer::Allocate(bytes, "bench")).value();
    BENCH_CHECK(cudaMemcpy(b.get(), p, bytes, cudaMemcpyHostToDevice));
    return b;
  };
  DeviceBuffer d_table = upload(table.data(), table.size() * 4),
               d_off = upload(offsets.data(), offsets.size() * 4),
               d_items = upload(items.data(), items.size() * sizeof(AttentionItem));
  std::vector<float> q(n_seq * 9 * 64, 0.01f);
  DeviceBuffer d_q = upload(q.data(), q.size() * 4);
  const int splits = AttentionSplits(n_tok - 1, 0);
  DeviceBuffer scratch =
      std::move(DeviceBuffer::Allocate(AttentionScratchFloats(n_seq, 9, 64, splits) * 4, "b")).value();
  DeviceBuffer out = std::move(DeviceBuffer::Allocate(n_seq * 9 * 64 * 2, "b")).value();
  AttentionArgs a;
  a.layout = L;
  a.kv_base = slab.get();
  a.n_heads = 9;
  a.page_tables = d_table.as<int32_t>();
  a.seq_page_offset = d_off.as<int32_t>();
  a.items = d_items.as<AttentionItem>();
  a.n_items = n_seq;
  a.max_splits = splits;
  a.q = d_q.as<float>();
  a.q_row_stride = 9 * 64;
  a.scratch = scratch.as<float>();
  a.out_f16 = out.as<uint16_t>();
  // One decode step's attention: every layer once, as the runner launches it.
  const double att_ms = TimeMs(s, 10, [&] {
    for (int l = 0; l < layers; ++l) {
      a.layer = l;
      (void)PagedAttention(a, s);
    }
  });
  BENCH_CHECK(cudaStreamSynchronize(s));
  const double kv_bytes = double{layers} * n_seq * n_tok * L.row_bytes() * 2;
  r.metrics["attention_64x4096_step_ms"] = att_ms;
  r.metrics["attention_64x4096_GBps"] = kv_bytes / (att_ms * 1e-3) / 1e9;
  r.ratio["attention_vs_hbm"] = kv_bytes / (att_ms * 1e-3) / hbm;
  r.notes["attention"] =
      "64 sessions x 4096 tokens, 30 layers (one decode step), SmolLM2 KV shape 9/3 heads hd 64 "
      "f16, shuffled pages; bytes = K+V read; baseline = D2D cudaMemcpy read+write bytes";
}

void OffloadRestore(std::shared_ptr<DeviceContext> ctx, bench::BenchReport& r) {
  const int64_t page = 30 * 2 * 16 * 3 * 64 * 2;  // 360 KiB
  const int n = 2048;                             // 720 MiB
  auto t0 = std::move(CudaTierStorage::Create(ctx, TierMemory::kDevice, n, page, "--tier0_bytes")).value();
  auto t1 =
      std::move(CudaTierStorage::Create(ctx, TierMemory::kPinnedHost, n, page, "--tier1_bytes")).value();
  cudaStream_t cs = ctx->copy_stream();
  const int64_t bytes = int64_t{n} * page;
  const double d2h_ms =
      TimeMs(cs, 5, [&] { cudaMemcpyAsync(t1->slab(), t0->slab(), bytes, cudaMemcpyDeviceToHost, cs); });
  const double h2d_ms =
      TimeMs(cs, 5, [&] { cudaMemcpyAsync(t0->slab(), t1->slab(), bytes, cudaMemcpyHostToDevice, cs); });
  std::vector<kv::PageId> src(n), dst(n);
  std::iota(src.begin(), src.end(), 0);
  std::iota(dst.begin(), dst.end(), 0);
  std::shuffle(src.begin(), src.end(), std::mt19937(2));
  std::shuffle(dst.begin(), dst.end(), std::mt19937(3));
  // Pages per CopyPages call: what the KV cache manager sends (copy_batch_bytes).
  const int batch = static_cast<int>(std::max<int64_t>(1, t0->copy_batch_bytes() / page));
  auto wall_ms = [](auto fn) {
    fn();
    std::vector<double> v;
    for (int i = 0; i < 5; ++i) {
      const auto a = std::chrono::steady_clock::now();
      fn();
      v.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - a).count());
    }
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  auto copy = [&](kv::TierStorage& to, const kv::TierStorage& from) {
    for (int b = 0; b < n; b += batch) {
      const int k = std::min(batch, n - b);
      BENCH_CHECK(
          to.CopyPages(from, absl::MakeConstSpan(src).subspan(b, k), absl::MakeConstSpan(dst).subspan(b, k)));
    }
  };
  const double off_ms = wall_ms([&] { copy(*t1, *t0); });
  const double res_ms = wall_ms([&] { copy(*t0, *t1); });
  // With the manager's verification: offload hashes each pinned page, restore
  // hashes the pinned source it was restored from.
  const double off_sum_ms = wall_ms([&] {
    copy(*t1, *t0);
    for (int i = 0; i < n; ++i) (void)t1->Checksum(dst[i]);
  });
  const double res_sum_ms = wall_ms([&] {
    copy(*t0, *t1);
    for (int i = 0; i < n; ++i) (void)t0->Checksum(dst[i]);
  });
  const double gb = bytes / 1e9;
  r.baseline["pinned_memcpy_d2h_GBps"] = gb / (d2h_ms * 1e-3);
  r.baseline["pinned_memcpy_h2d_GBps"] = gb / (h2d_ms * 1e-3);
  r.metrics["offload_copypages_GBps"] = gb / (off_ms * 1e-3);
  r.metrics["restore_copypages_GBps"] = gb / (res_ms * 1e-3);
  r.metrics["offload_with_checksums_GBps"] = gb / (off_sum_ms * 1e-3);
  r.metrics["restore_with_checksums_GBps"] = gb / (res_sum_ms * 1e-3);
  r.ratio["offload_vs_pinned_memcpy"] = d2h_ms / off_ms;
  r.ratio["restore_vs_pinned_memcpy"] = h2d_ms / res_ms;
  // The same batches by each copy path (the ratios above use the default, kAuto).
  const std::pair<const char*, CopyPath> paths[] = {
      {"kernel", CopyPath::kKernel}, {"batched", CopyPath::kBatched}, {"memcpy", CopyPath::kMemcpy}};
  for (const auto& [name, path] : paths) {
    t0->set_copy_path(path);
    t1->set_copy_path(path);
    // A path the driver refuses is reported (-1), not fatal.
    const absl::Status probe =
        t1->CopyPages(*t0, absl::MakeConstSpan(src).subspan(0, 1), absl::MakeConstSpan(dst).subspan(0, 1));
    if (!probe.ok()) {
      std::fprintf(stderr, "copy path %s: %s\n", name, probe.ToString().c_str());
      r.metrics[std::string("offload_copypages_GBps_") + name] = -1;
      continue;
    }
    r.metrics[std::string("offload_copypages_GBps_") + name] = gb / (wall_ms([&] { copy(*t1, *t0); }) * 1e-3);
    r.metrics[std::string("restore_copypages_GBps_") + name] = gb / (wall_ms([&] { copy(*t0, *t1); }) * 1e-3);
  }
  t0->set_copy_path(CopyPath::kAuto);
  t1->set_copy_path(CopyPath::kAuto);
  r.notes["offload"] =
      "2048 pages of 360 KiB (SmolLM2), shuffled ids (no coalescing), CopyPages batches of " +
      std::to_string(batch) +
      " (copy_batch_bytes); baseline = one pinned cudaMemcpyAsync of "
      "the same bytes; _kernel/_batched/_memcpy: the same by each CopyPath";
}

void WeightKernels(const DeviceContext& ctx, bench::BenchReport& r) {
  cudaStream_t s = ctx.compute_stream();
  const int64_t rows = 14336, cols = 4096;
  const double hbm = r.baseline.at("hbm_d2d_copy_GBps") * 1e9;
  // Activations and outputs for up to 64 tokens; one f16 slice buffer as the runner sizes it.
  const int max_t = 64;
  DeviceBuffer x = std::move(DeviceBuffer::Allocate(max_t * cols * 2, "bench x")).value();
  DeviceBuffer y = std::move(DeviceBuffer::Allocate(max_t * rows * 4, "bench y")).value();
  BENCH_CHECK(cudaMemsetAsync(x.get(), 0x3c, max_t * cols * 2, s));  // 1.0 in f16
  const int64_t slice_rows = std::min<int64_t>(rows, (int64_t{8} << 20) / cols);
  DeviceBuffer slice = std::move(DeviceBuffer::Allocate(slice_rows * cols * 2, "bench slice")).value();
  // Random values quantised once on the host: one row repeated (quantising 58M
  // values takes seconds; the kernels' speed does not depend on the values).
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-0.05f, 0.05f);
  std::vector<float> row(cols);
  for (float& v : row) v = u(rng);
  for (gguf::GgmlType type :
       {gguf::GgmlType::kF16, gguf::GgmlType::kQ4_K, gguf::GgmlType::kQ6_K, gguf::GgmlType::kQ8_0}) {
    const std::string name(gguf::TypeName(type));
    const int64_t row_bytes = *gguf::RowBytes(type, cols);
    std::vector<uint8_t> one(row_bytes);
    BENCH_CHECK(gguf::QuantizeRow(type, row.data(), one.data(), cols));
    std::vector<uint8_t> host(rows * row_bytes);
    for (int64_t i = 0; i < rows; ++i) std::copy(one.begin(), one.end(), host.begin() + i * row_bytes);
    DeviceBuffer data = std::move(DeviceBuffer::Allocate(rows * row_bytes, "bench weights")).value();
    BENCH_CHECK(cudaMemcpy(data.get(), host.data(), host.size(), cudaMemcpyHostToDevice));
    const DeviceWeight w{type, rows, cols, row_bytes, data.as<uint8_t>()};
    auto matvec = [&](int t) { BENCH_CHECK(MatVec(w, x.as<uint16_t>(), t, y.as<float>(), rows, 0.0f, s)); };
    auto dequant_gemm = [&](int t) {
      for (int64_t r0 = 0; r0 < rows; r0 += slice_rows) {
        const int64_t n = std::min(slice_rows, rows - r0);
        BENCH_CHECK(DequantizeRowsToF16(w, r0, n, slice.as<uint16_t>(), s));
        BENCH_CHECK(GemmF16(ctx.cublas(), slice.as<uint16_t>(), n, cols, x.as<uint16_t>(), t,
                            y.as<float>() + r0, rows, 0.0f));
      }
    };
    auto f16_gemm = [&](int t) {
      BENCH_CHECK(GemmF16(ctx.cublas(), reinterpret_cast<const uint16_t*>(w.data), rows, cols,
                          x.as<uint16_t>(), t, y.as<float>(), rows, 0.0f));
    };
    const double mv1 = TimeMs(s, 20, [&] { matvec(1); });
    r.ratio["matvec_" + name + "_vs_hbm"] = rows * row_bytes / (mv1 * 1e-3) / hbm;
    for (int t : {1, 8, 16, 64}) {
      const std::string key = "matmul_" + name + "_t" + std::to_string(t) + "_ms";
      if (type == gguf::GgmlType::kF16) {
        r.baseline[key] = TimeMs(s, 20, [&] { t <= kMatVecMaxTokens ? matvec(t) : f16_gemm(t); });
        if (t == 8) r.baseline["matmul_f16_t8_gemm_ms"] = TimeMs(s, 20, [&] { f16_gemm(t); });
      } else {
        r.metrics[key] = TimeMs(s, 20, [&] { t <= kMatVecMaxTokens ? matvec(t) : dequant_gemm(t); });
        // Above 1: faster than the same product on f16 weights (F16 runs first).
        r.ratio["matmul_" + name + "_t" + std::to_string(t) + "_vs_f16"] =
            r.baseline.at("matmul_f16_t" + std::to_string(t) + "_ms") / r.metrics[key];
        if (t == 8)
          r.metrics["matmul_" + name + "_t8_dequant_gemm_ms"] = TimeMs(s, 20, [&] { dequant_gemm(t); });
      }
    }
  }
  r.notes["weight_kernels"] =
      "14336x4096 matrix (Llama 3 8B FFN) in each encoding; matmul_<type>_t<N>_ms is the runner's route "
      "(MatVec up to kMatVecMaxTokens = " +
      std::to_string(kMatVecMaxTokens) +
      " tokens, else 16 MiB dequantised f16 slices + cublasGemmEx); baseline matmul_f16_*: f16 weights, "
      "MatVec up to the same count, else cublasGemmEx";
}

// Bytes of the model's 2-D weight matrices: as stored, and as f16.
std::pair<int64_t, int64_t> MatrixBytes(const model::LlamaModel& m) {
  int64_t file = 0, f16 = 0;
  auto add = [&](const model::WeightView& v) {
    file += v.rows * *gguf::RowBytes(v.type, v.cols);
    f16 += v.rows * v.cols * 2;
  };
  for (const model::LlamaLayer& L : m.layers()) {
    for (const model::WeightView* v : {&L.wq, &L.wk, &L.wv, &L.wo, &L.w_gate, &L.w_up, &L.w_down}) add(*v);
  }
  add(m.token_embd());
  if (m.output().data != m.token_embd().data) add(m.output());
  return {file, f16};
}

void Decode(backend::CudaBackend& backend, bench::BenchReport& r) {
  std::unique_ptr<model::LlamaModel> m;
  auto real = model::LlamaModel::Load(gguf::DefaultModelPath());
  if (real.ok()) {
    m = std::move(*real);
    r.notes["decode_model"] = "SmolLM2-135M-Instruct Q4_1 (real file)";
  } else {
    auto file =
        gguf::GgufFile::OpenFromBuffer(std::move(gguf::BuildTinyLlama(gguf::SmolLM2ShapedOptions())).value());
    m = std::move(model::LlamaModel::FromFile(std::move(*file))).value();
    r.notes["decode_model"] =
        "synthetic SmolLM2 shapes (30 layers, 576, 9/3 heads, ff 1536, Q4_1) but a " +
        std::to_string(m->hparams().n_vocab) +
        "-token vocabulary: the 49152x576 output projection (~21% of weight bytes) is absent";
  }
  const auto& hp = m->hparams();
  kv::KvCacheOptions o;
  o.shape = kv::KvShape{static_cast<int>(hp.n_layer),
                        static_cast<int>(hp.n_head_kv),
                        static_cast<int>(hp.head_dim),
                        kv::KvDtype::kF16,
                        16,
                        0};
  o.model_id = m->model_id();
  o.tier0_bytes = 64 * 40 * o.shape.page_bytes();
  o.storage_factory = backend.MakeTierStorageFactory();
  auto kv = std::move(kv::KvCacheManager::Create(o)).value();
  size_t free_before = 0, free_after = 0, total = 0;
  BENCH_CHECK(cudaMemGetInfo(&free_before, &total));
  auto runner = std::move(backend.CreateRunner(*m, kv->tier_storage(0), o.shape, {512})).value();
  BENCH_CHECK(cudaMemGetInfo(&free_after, &total));
  const auto [file_bytes, f16_bytes] = MatrixBytes(*m);
  r.metrics["runner_device_bytes"] = static_cast<double>(free_before - free_after);
  r.metrics["weights_file_bytes"] = static_cast<double>(file_bytes);
  r.baseline["weights_f16_bytes"] = static_cast<double>(f16_bytes);
  r.ratio["runner_device_bytes_vs_f16_weights"] = static_cast<double>(free_before - free_after) / f16_bytes;
  r.notes["runner_device_bytes"] =
      "device memory CreateRunner took (cudaMemGetInfo, 2 MiB granularity): weights in their file encoding, "
      "activations for 512 tokens, the 16 MiB f16 slice buffer, the RoPE table";
  // The same figures launch by launch (--cuda_graphs=false), in the same run.
  auto eager = std::move(backend.CreateRunner(*m, kv->tier_storage(0), o.shape, {512, false})).value();
  const std::pair<model::ModelRunner*, std::string> runs[] = {{runner.get(), ""}, {eager.get(), "_eager"}};
  const int context = 256, steps = 32;
  std::vector<std::string> ids;
  // One step of n_tokens new tokens for every session in `ids`, logits to the host.
  auto step = [&](model::ModelRunner& run, int n_tokens) {
    std::vector<kv::StepReservation> res;
    std::vector<std::vector<int32_t>> toks;
    std::vector<model::SequenceStep> seq;
    for (const std::string& id : ids) {
      res.push_back(std::move(kv->BeginStep(id, n_tokens)).value());
      toks.emplace_back(n_tokens, 7);
    }
    for (size_t i = 0; i < ids.size(); ++i)
      seq.push_back({toks[i], res[i].first_pos, res[i].page_table, true});
    BENCH_CHECK(run.ForwardView(seq).status());  // the engine's path: logits left in the runner's buffer
    for (size_t i = 0; i < ids.size(); ++i) BENCH_CHECK(kv->CommitStep(ids[i], toks[i]));
  };
  for (int batch : {1, 16, 64}) {
    for (const auto& [run, suffix] : runs) {
      ids.clear();
      for (int i = 0; i < batch; ++i) {
        ids.push_back("b" + std::to_string(batch) + suffix + "_" + std::to_string(i));
        BENCH_CHECK(kv->CreateSession(ids.back(), "t"));
      }
      for (const std::string& id : ids) {  // prefill one session at a time
        std::vector<std::string> one = {id};
        std::swap(ids, one);
        step(*run, context);
        std::swap(ids, one);
      }
      step(*run, 1);  // warm-up (and the graph's capture)
      const auto a = std::chrono::steady_clock::now();
      for (int s = 0; s < steps; ++s) step(*run, 1);
      const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count();
      const std::string b = std::to_string(batch);
      r.metrics["decode_tokens_per_s_batch" + b + suffix] = batch * steps / sec;
      r.metrics["decode_step_ms_batch" + b + suffix] = sec / steps * 1e3;
      for (const std::string& id : ids) BENCH_CHECK(kv->CloseSession(id));
    }
    const std::string b = std::to_string(batch);
    r.ratio["decode_graphs_vs_eager_batch" + b] =
        r.metrics["decode_tokens_per_s_batch" + b] / r.metrics["decode_tokens_per_s_batch" + b + "_eager"];
  }
  r.notes["decode"] =
      "context 256 tokens per session, 32 timed steps, KV cache BeginStep/CommitStep included, "
      "logits copied to the host every step; CUDA graphs (the default), and _eager: --cuda_graphs=false";

  // A new 20-token turn on a session whose 2,000-token history is cached: the
  // time to its first token (tests/gpu/hf_peer.py times the same turn recomputed
  // by transformers, hf_ttft_recompute_2000_ms). Each turn stays in the history
  // (2,020 to 2,100 tokens); with graphs, 20 tokens replay the 24-token graph.
  const int history = 2000, turn = 20;
  for (const auto& [run, suffix] : runs) {
    ids = {"history" + suffix};
    BENCH_CHECK(kv->CreateSession(ids[0], "t"));
    for (int done = 0; done < history; done += 500) step(*run, 500);
    step(*run, turn);  // warm-up
    std::vector<double> ms;
    for (int rep = 0; rep < 5; ++rep) {
      const auto a = std::chrono::steady_clock::now();
      step(*run, turn);
      ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - a).count());
    }
    std::sort(ms.begin(), ms.end());
    r.metrics["ttft_cached_history2000" + suffix + "_ms"] = ms[ms.size() / 2];
    BENCH_CHECK(kv->CloseSession(ids[0]));
  }
  r.notes["ttft_cached_history2000_ms"] =
      "median of 5 turns of 20 new tokens on one session with 2,000+ cached tokens: one Forward, KV "
      "BeginStep/CommitStep and the logits copy included; _eager: --cuda_graphs=false";
  const CudaGraphStats gs = GetCudaGraphStats(*runner);
  r.metrics["graph_captures"] = static_cast<double>(gs.captures);
  r.metrics["graph_replays"] = static_cast<double>(gs.replays);
  if (!gs.error.empty()) r.notes["graph_error"] = gs.error;
}

}  // namespace
}  // namespace kvcache::cuda

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  using namespace kvcache;
  auto ctx = cuda::DeviceContext::Create(0);
  if (!ctx.ok()) {
    std::fprintf(stderr, "gpu_bench: %s\n", ctx.status().ToString().c_str());
    return 2;
  }
  bench::BenchReport r;
  r.benchmark = "gpu";
  r.notes["device"] = (*ctx)->Describe();
  cuda::HbmAndAttention(**ctx, r);
  cuda::OffloadRestore(*ctx, r);
  cuda::WeightKernels(**ctx, r);
  auto backend = kvcache_cuda_backend_v1()->Create({0});
  if (!backend.ok()) {
    std::fprintf(stderr, "gpu_bench: %s\n", backend.status().ToString().c_str());
    return 2;
  }
  cuda::Decode(**backend, r);
  const absl::Status st = bench::Finish(r);
  if (!st.ok()) {
    std::fprintf(stderr, "%s\n", st.ToString().c_str());
    return 1;
  }
  return 0;
}
