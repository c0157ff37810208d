// Test doubles for the engine: a pure-logic "model" and an observer.
//
// FakeRunner writes each token id into its KV slot and predicts the next token
// from every id it reads back through the page table, so a wrong page table,
// position or cache reuse changes the output. Reference() computes the same
// function on the true token list.
#ifndef KVCACHE_TESTS_WORKER_SCHED_FAKE_RUNNER_H_
#define KVCACHE_TESTS_WORKER_SCHED_FAKE_RUNNER_H_

#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/gguf/gguf_reader.h"
#include "common/gguf/tiny_llama.h"
#include "common/tokenizer/tokenizer.h"
#include "worker/kv/kv_cache_manager.h"
#include "worker/model/model_runner.h"
#include "worker/sched/engine.h"

namespace kvcache::sched {

inline constexpr int kFirstByteToken = 3;

// Next token after `context`: a byte token chosen by a position-weighted sum.
inline int32_t Reference(const std::vector<int32_t>& context) {
  uint64_t h = 0;
  for (size_t p = 0; p < context.size(); ++p) h += (p + 1) * static_cast<uint64_t>(context[p]);
  return kFirstByteToken + static_cast<int32_t>('a' + h % 26);  // printable letters
}

class FakeRunner : public model::ModelRunner {
 public:
  FakeRunner(kv::KvCacheManager* kv, int64_t vocab) : kv_(kv) {
    hp_.n_vocab = vocab;
    hp_.n_ctx_train = 512;
  }
  const gguf::LlamaHparams& hparams() const override { return hp_; }
  int max_batch_tokens() const override { return 64; }

  absl::Status Forward(absl::Span<const model::SequenceStep> batch, std::vector<float>* logits) override {
    if (gate_ != nullptr) gate_->WaitForNotification();
    {
      absl::MutexLock lock(&step_mu_);
      ++entered_;
      auto allowed = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(step_mu_) {
        return step_limit_ < 0 || steps_ < step_limit_;
      };
      step_mu_.Await(absl::Condition(&allowed));
      ++steps_;
    }
    max_sequences_ = std::max(max_sequences_, static_cast<int>(batch.size()));
    const kv::KvShape& s = kv_->shape();
    logits->clear();
    for (const auto& seq : batch) {
      // Write the new tokens into their slots (layer 0, K, element 0).
      for (size_t i = 0; i < seq.tokens.size(); ++i) {
        const int64_t pos = seq.first_pos + static_cast<int64_t>(i);
        float v = static_cast<float>(seq.tokens[i]);
        std::memcpy(Slot(seq, pos), &v, sizeof(v));
      }
      if (!seq.want_logits) continue;
      // Read every position back through the page table.
      std::vector<int32_t> context;
      const int64_t n = seq.first_pos + static_cast<int64_t>(seq.tokens.size());
      for (int64_t pos = 0; pos < n; ++pos) {
        float v;
        std::memcpy(&v, Slot(seq, pos), sizeof(v));
        context.push_back(static_cast<int32_t>(v));
      }
      std::vector<float> row(static_cast<size_t>(hp_.n_vocab), 0.0f);
      row[Reference(context)] = 1.0f;
      logits->insert(logits->end(), row.begin(), row.end());
    }
    (void)s;
    return absl::OkStatus();
  }

  // What every Forward reports as its products' and attention's time.
  ForwardProfile last_forward_profile() const override { return profile_; }
  ForwardProfile profile_;

  // With threaded_parallel_for_, each call of a ParallelFor runs on its own
  // thread, last index first (as a pool may), instead of in order on the caller.
  void ParallelFor(int64_t n, absl::FunctionRef<void(int64_t)> fn) override {
    if (!threaded_parallel_for_) return model::ModelRunner::ParallelFor(n, fn);
    std::vector<std::thread> threads;
    for (int64_t i = n - 1; i >= 0; --i) threads.emplace_back([&fn, i] { fn(i); });
    for (std::thread& t : threads) t.join();
  }
  bool threaded_parallel_for_ = false;

  // Steps run one at a time under the test's control: Forward blocks once
  // `limit` steps have run until AllowSteps raises it (-1: no limit).
  void LimitSteps(int limit) {
    absl::MutexLock lock(&step_mu_);
    step_limit_ = limit;
  }
  void AllowSteps(int more) {
    absl::MutexLock lock(&step_mu_);
    step_limit_ += more;
  }
  int steps() {
    absl::MutexLock lock(&step_mu_);
    return steps_;
  }
  // Blocks until `n` steps have entered Forward.
  void WaitForSteps(int n) {
    absl::MutexLock lock(&step_mu_);
    auto reached = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(step_mu_) { return steps_ >= n; };
    step_mu_.Await(absl::Condition(&reached));
  }

  // Blocks until Forward has been called `n` times (the n-th call may be
  // waiting for AllowSteps: the engine is then in the middle of that step).
  void WaitForEntered(int n) {
    absl::MutexLock lock(&step_mu_);
    auto reached = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(step_mu_) { return entered_ >= n; };
    step_mu_.Await(absl::Condition(&reached));
  }

  absl::Notification* gate_ = nullptr;
  int max_sequences_ = 0;
  int steps_ = 0;  // read by tests once the engine is idle (else steps())

 private:
  uint8_t* Slot(const model::SequenceStep& seq, int64_t pos) {
    const kv::KvShape& s = kv_->shape();
    const kv::PageId page = seq.page_table[pos / s.page_tokens];
    return kv_->Tier0PageData(page) + kv::KOffset(s, 0, static_cast<int>(pos % s.page_tokens));
  }

  kv::KvCacheManager* kv_;
  gguf::LlamaHparams hp_;
  absl::Mutex step_mu_;
  int step_limit_ = -1;
  int entered_ = 0;  // Forward calls, counted before they wait for the limit
};

// Collects what the engine streams for one request.
class Collector : public GenerateObserver {
 public:
  void OnToken(int32_t id, absl::string_view text) override {
    tokens.push_back(id);
    text_.append(text.data(), text.size());
  }
  void OnDone(const absl::Status& s, const GenerateResult& r) override {
    status = s;
    result = r;
    done.Notify();
  }
  const GenerateResult& Wait() {
    done.WaitForNotification();
    return result;
  }
  std::vector<int32_t> tokens;
  std::string text_;
  absl::Status status;
  GenerateResult result;
  absl::Notification done;
};

// An engine over FakeRunner with the tiny test vocabulary: 1 layer, 1 KV head of
// 4 floats, 16-token pages. Members are destroyed engine first.
struct EngineBed {
  std::unique_ptr<tok::Tokenizer> tokenizer;
  std::unique_ptr<kv::KvCacheManager> kv;
  std::unique_ptr<FakeRunner> runner;
  std::unique_ptr<Engine> engine;
};

inline absl::StatusOr<EngineBed> MakeEngineBed(int tier0_pages, int tier1_pages, EngineOptions options = {}) {
  EngineBed bed;
  auto bytes = gguf::BuildTinyLlama({});
  if (!bytes.ok()) return bytes.status();
  auto file = gguf::GgufFile::OpenFromBuffer(*bytes);
  if (!file.ok()) return file.status();
  auto tok = tok::Tokenizer::FromGguf(**file);
  if (!tok.ok()) return tok.status();
  bed.tokenizer = std::move(*tok);
  kv::KvCacheOptions ko;
  ko.shape = kv::KvShape{1, 1, 4, kv::KvDtype::kF32, 16, 0};
  ko.model_id = "fake";
  ko.tier0_bytes = tier0_pages * ko.shape.page_bytes();
  ko.tier1_bytes = tier1_pages * ko.shape.page_bytes();
  auto kv = kv::KvCacheManager::Create(ko);
  if (!kv.ok()) return kv.status();
  bed.kv = std::move(*kv);
  bed.runner = std::make_unique<FakeRunner>(bed.kv.get(), bed.tokenizer->n_vocab());
  auto e = Engine::Create(options, bed.runner.get(), bed.kv.get(), bed.tokenizer.get());
  if (!e.ok()) return e.status();
  bed.engine = std::move(*e);
  return bed;
}

}  // namespace kvcache::sched

#endif  // KVCACHE_TESTS_WORKER_SCHED_FAKE_RUNNER_H_
