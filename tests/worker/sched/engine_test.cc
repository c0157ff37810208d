// Engine scheduling tests against a pure-logic model: the "model" writes each
// token id into its KV slot and predicts the next token from every id it reads
// back through the page table, so a wrong page table, position or cache reuse
// changes the output. The reference computes the same function on the true
// token list.
#include "worker/sched/engine.h"

#include <cstring>

#include "absl/synchronization/notification.h"
#include "common/gguf/gguf_reader.h"
#include "common/gguf/tiny_llama.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcache::sched {
namespace {

constexpr int kFirstByteToken = 3;

// Next token after `context`: a byte token chosen by a position-weighted sum.
int32_t Reference(const std::vector<int32_t>& context) {
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
    max_sequences_ = std::max(max_sequences_, static_cast<int>(batch.size()));
    ++steps_;
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

  absl::Notification* gate_ = nullptr;
  int max_sequences_ = 0;
  int steps_ = 0;

 private:
  uint8_t* Slot(const model::SequenceStep& seq, int64_t pos) {
    const kv::KvShape& s = kv_->shape();
    const kv::PageId page = seq.page_table[pos / s.page_tokens];
    return kv_->Tier0PageData(page) + kv::KOffset(s, 0, static_cast<int>(pos % s.page_tokens));
  }

  kv::KvCacheManager* kv_;
  gguf::LlamaHparams hp_;
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

class EngineTest : public ::testing::Test {
 protected:
  void SetUp() override { Build(/*tier0_pages=*/64, /*tier1_pages=*/64); }

  void Build(int tier0_pages, int tier1_pages, EngineOptions options = {}) {
    engine_.reset();
    auto bytes = gguf::BuildTinyLlama({});
    ASSERT_TRUE(bytes.ok()) << bytes.status();
    auto file = gguf::GgufFile::OpenFromBuffer(*bytes);
    ASSERT_TRUE(file.ok());
    auto tok = tok::Tokenizer::FromGguf(**file);
    ASSERT_TRUE(tok.ok()) << tok.status();
    tokenizer_ = std::move(*tok);
    kv::KvCacheOptions ko;
    ko.shape = kv::KvShape{1, 1, 4, kv::KvDtype::kF32, 16, 0};
    ko.model_id = "fake";
    ko.tier0_bytes = tier0_pages * ko.shape.page_bytes();
    ko.tier1_bytes = tier1_pages * ko.shape.page_bytes();
    auto kv = kv::KvCacheManager::Create(ko);
    ASSERT_TRUE(kv.ok()) << kv.status();
    kv_ = std::move(*kv);
    runner_ = std::make_unique<FakeRunner>(kv_.get(), tokenizer_->n_vocab());
    auto e = Engine::Create(options, runner_.get(), kv_.get(), tokenizer_.get());
    ASSERT_TRUE(e.ok()) << e.status();
    engine_ = std::move(*e);
  }

  void TearDown() override {
    engine_.reset();
    if (kv_) {
      EXPECT_TRUE(kv_->CheckInvariants().ok()) << kv_->CheckInvariants();
    }
  }

  static std::vector<int32_t> Prompt(int n, int salt = 0) {
    std::vector<int32_t> p;
    for (int i = 0; i < n; ++i) p.push_back(kFirstByteToken + 'A' + (i * 7 + salt) % 26);
    return p;
  }

  static std::vector<int32_t> Expected(std::vector<int32_t> context, int n) {
    std::vector<int32_t> out;
    for (int i = 0; i < n; ++i) {
      out.push_back(Reference(context));
      context.push_back(out.back());
    }
    return out;
  }

  GenerateRequest Req(const std::string& session, RequestMode mode, std::vector<int32_t> input,
                      int max_tokens, const std::string& tenant = "t") {
    GenerateRequest r;
    r.session_id = session;
    r.tenant = tenant;
    r.mode = mode;
    r.input = std::move(input);
    r.max_tokens = max_tokens;
    return r;
  }

  std::unique_ptr<tok::Tokenizer> tokenizer_;
  std::unique_ptr<kv::KvCacheManager> kv_;
  std::unique_ptr<FakeRunner> runner_;
  std::unique_ptr<Engine> engine_;
};

TEST_F(EngineTest, EphemeralRequestGeneratesAndFreesItsSession) {
  Collector c;
  auto prompt = Prompt(37);
  ASSERT_TRUE(engine_->Submit(Req("", RequestMode::kFullContext, prompt, 10), &c).ok());
  const GenerateResult& r = c.Wait();
  ASSERT_TRUE(c.status.ok()) << c.status;
  EXPECT_EQ(c.tokens, Expected(prompt, 10));
  EXPECT_EQ(r.output, c.tokens);
  EXPECT_EQ(r.finish, FinishReason::kLength);
  EXPECT_EQ(r.prompt_tokens, 37);
  EXPECT_EQ(r.cached_tokens, 0);
  EXPECT_EQ(r.generated_tokens, 10);
  EXPECT_GT(r.time_to_first_token, absl::ZeroDuration());
  EXPECT_EQ(c.text_.size(), 10u);  // byte tokens: one letter each
  ASSERT_TRUE(engine_->WaitIdle(absl::Seconds(10)));
  EXPECT_EQ(kv_->GetStats().sessions, 0);
}

TEST_F(EngineTest, AppendTurnReusesTheWholeConversation) {
  Collector t1, t2;
  auto p1 = Prompt(40);
  ASSERT_TRUE(engine_->Submit(Req("chat", RequestMode::kFullContext, p1, 8), &t1).ok());
  t1.Wait();
  ASSERT_TRUE(t1.status.ok());
  auto p2 = Prompt(21, 5);
  ASSERT_TRUE(engine_->Submit(Req("chat", RequestMode::kAppend, p2, 8), &t2).ok());
  const GenerateResult& r2 = t2.Wait();
  ASSERT_TRUE(t2.status.ok()) << t2.status;
  std::vector<int32_t> full = p1;
  full.insert(full.end(), t1.tokens.begin(), t1.tokens.end());
  // Every token of turn 1 except the last sampled one has K/V already.
  EXPECT_EQ(r2.cached_tokens, static_cast<int64_t>(full.size()) - 1);
  full.insert(full.end(), p2.begin(), p2.end());
  EXPECT_EQ(r2.prompt_tokens, static_cast<int64_t>(full.size()));
  EXPECT_EQ(t2.tokens, Expected(full, 8));
}

TEST_F(EngineTest, FullContextTurnKeepsTheCommonPrefix) {
  Collector t1, t2;
  auto p1 = Prompt(33);
  ASSERT_TRUE(engine_->Submit(Req("s", RequestMode::kFullContext, p1, 6), &t1).ok());
  t1.Wait();
  std::vector<int32_t> full = p1;
  full.insert(full.end(), t1.tokens.begin(), t1.tokens.end());
  auto more = Prompt(5, 9);
  full.insert(full.end(), more.begin(), more.end());
  ASSERT_TRUE(engine_->Submit(Req("s", RequestMode::kFullContext, full, 6), &t2).ok());
  t2.Wait();
  ASSERT_TRUE(t2.status.ok());
  EXPECT_EQ(t2.result.cached_tokens, 33 + 6 - 1);
  EXPECT_EQ(t2.tokens, Expected(full, 6));

  // A diverging history keeps only the common part.
  Collector t3;
  std::vector<int32_t> edited(p1.begin(), p1.begin() + 20);
  auto tail = Prompt(7, 3);
  edited.insert(edited.end(), tail.begin(), tail.end());
  ASSERT_TRUE(engine_->Submit(Req("s", RequestMode::kFullContext, edited, 4), &t3).ok());
  t3.Wait();
  EXPECT_EQ(t3.result.cached_tokens, 20);
  EXPECT_EQ(t3.tokens, Expected(edited, 4));
}

TEST_F(EngineTest, PrefixSharedWithinTenantOnly) {
  Collector a, b, c;
  auto system = Prompt(48);
  auto pa = system, pb = system, pc = system;
  for (int32_t t : Prompt(9, 1)) pa.push_back(t);
  for (int32_t t : Prompt(9, 2)) pb.push_back(t);
  for (int32_t t : Prompt(9, 2)) pc.push_back(t);
  ASSERT_TRUE(engine_->Submit(Req("a", RequestMode::kFullContext, pa, 2, "t1"), &a).ok());
  a.Wait();
  ASSERT_TRUE(engine_->Submit(Req("b", RequestMode::kFullContext, pb, 2, "t1"), &b).ok());
  b.Wait();
  ASSERT_TRUE(engine_->Submit(Req("c", RequestMode::kFullContext, pc, 2, "t2"), &c).ok());
  c.Wait();
  EXPECT_EQ(b.result.cached_tokens, 48);  // three full pages of the shared prompt
  EXPECT_EQ(c.result.cached_tokens, 0);   // another tenant sees nothing
  EXPECT_EQ(b.tokens, Expected(pb, 2));
  EXPECT_EQ(c.tokens, b.tokens);
}

TEST_F(EngineTest, ConcurrentRequestsShareSteps) {
  absl::Notification gate;
  runner_->gate_ = &gate;
  std::vector<std::unique_ptr<Collector>> cs;
  for (int i = 0; i < 4; ++i) {
    cs.push_back(std::make_unique<Collector>());
    ASSERT_TRUE(
        engine_->Submit(Req("", RequestMode::kFullContext, Prompt(10 + i, i), 5), cs.back().get()).ok());
  }
  gate.Notify();
  for (int i = 0; i < 4; ++i) {
    cs[i]->Wait();
    ASSERT_TRUE(cs[i]->status.ok());
    EXPECT_EQ(cs[i]->tokens, Expected(Prompt(10 + i, i), 5));
  }
  EXPECT_GE(runner_->max_sequences_, 3);  // decode and prefill of others in one step
  EXPECT_LT(runner_->steps_, 4 * 6);      // far fewer steps than running them one by one
}

TEST_F(EngineTest, SecondRequestOnBusySessionIsAborted) {
  absl::Notification gate;
  runner_->gate_ = &gate;
  Collector first, second;
  ASSERT_TRUE(engine_->Submit(Req("s", RequestMode::kFullContext, Prompt(5), 3), &first).ok());
  auto st = engine_->Submit(Req("s", RequestMode::kFullContext, Prompt(6), 3), &second);
  EXPECT_EQ(st.status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(engine_->CloseSession("s", "t").code(), absl::StatusCode::kAborted);
  gate.Notify();
  first.Wait();
  EXPECT_TRUE(first.status.ok());
  EXPECT_TRUE(engine_->CloseSession("s", "t").ok());
}

TEST_F(EngineTest, BadRequestsAreRefusedUpFront) {
  Collector c;
  EXPECT_EQ(engine_->Submit(Req("", RequestMode::kFullContext, {}, 3), &c).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(engine_->Submit(Req("", RequestMode::kFullContext, {999999}, 3), &c).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(engine_->Submit(Req("", RequestMode::kFullContext, {-1}, 3), &c).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(engine_->Submit(Req("nope", RequestMode::kAppend, Prompt(3), 3), &c).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(engine_->Submit(Req("", RequestMode::kAppend, Prompt(3), 3), &c).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(engine_->Submit(Req("", RequestMode::kFullContext, Prompt(600), 3), &c).status().code(),
            absl::StatusCode::kInvalidArgument);  // over the 512-token model context
  EXPECT_EQ(engine_->Submit(Req("", RequestMode::kFullContext, Prompt(3), -1), &c).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(engine_->Submit(Req("", RequestMode::kFullContext, Prompt(3), 100000), &c).status().code(),
            absl::StatusCode::kInvalidArgument);
  GenerateRequest hot = Req("", RequestMode::kFullContext, Prompt(3), 3);
  hot.sampling.temperature = 5;
  EXPECT_EQ(engine_->Submit(hot, &c).status().code(), absl::StatusCode::kInvalidArgument);
  // Another tenant cannot append to (or even see) a session.
  Collector owner;
  ASSERT_TRUE(engine_->Submit(Req("mine", RequestMode::kFullContext, Prompt(4), 2, "t1"), &owner).ok());
  owner.Wait();
  EXPECT_EQ(engine_->Submit(Req("mine", RequestMode::kAppend, Prompt(3), 3, "t2"), &c).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(engine_->CloseSession("mine", "t2").code(), absl::StatusCode::kNotFound);
  EXPECT_FALSE(c.done.HasBeenNotified());
}

TEST_F(EngineTest, PromptLargerThanTier0IsResourceExhausted) {
  Build(/*tier0_pages=*/4, /*tier1_pages=*/4);
  Collector c;
  EXPECT_EQ(engine_->Submit(Req("", RequestMode::kFullContext, Prompt(100), 3), &c).status().code(),
            absl::StatusCode::kResourceExhausted);
}

TEST_F(EngineTest, CancelFreesPages) {
  absl::Notification gate;
  runner_->gate_ = &gate;
  Collector c;
  auto id = engine_->Submit(Req("", RequestMode::kFullContext, Prompt(50), 200), &c);
  ASSERT_TRUE(id.ok());
  engine_->Cancel(*id);
  gate.Notify();
  c.Wait();
  EXPECT_EQ(c.status.code(), absl::StatusCode::kCancelled);
  ASSERT_TRUE(engine_->WaitIdle(absl::Seconds(10)));
  auto stats = kv_->GetStats();
  EXPECT_EQ(stats.sessions, 0);
  EXPECT_EQ(stats.tier[0].session_private_pages, 0);
}

TEST_F(EngineTest, DeadlineEndsTheRequest) {
  Collector c;
  GenerateRequest r = Req("", RequestMode::kFullContext, Prompt(5), 100);
  r.deadline = absl::Now() - absl::Seconds(1);
  ASSERT_TRUE(engine_->Submit(r, &c).ok());
  c.Wait();
  EXPECT_EQ(c.status.code(), absl::StatusCode::kDeadlineExceeded);
}

TEST_F(EngineTest, StopStringAndStopToken) {
  auto prompt = Prompt(12);
  auto expected = Expected(prompt, 20);
  // Stop at the 4th generated letter.
  std::string stop(1, static_cast<char>(expected[3] - kFirstByteToken));
  // Use a two-letter stop string straddling tokens 3 and 4.
  stop = std::string{static_cast<char>(expected[2] - kFirstByteToken),
                     static_cast<char>(expected[3] - kFirstByteToken)};
  Collector c;
  GenerateRequest r = Req("", RequestMode::kFullContext, prompt, 20);
  r.stop = {stop};
  ASSERT_TRUE(engine_->Submit(r, &c).ok());
  c.Wait();
  EXPECT_EQ(c.result.finish, FinishReason::kStopString);
  EXPECT_LE(c.tokens.size(), 4u);
  EXPECT_NE(c.text_.find(stop), std::string::npos);

  Collector d;
  GenerateRequest s = Req("", RequestMode::kFullContext, prompt, 20);
  s.stop_token_ids = {expected[5]};
  ASSERT_TRUE(engine_->Submit(s, &d).ok());
  d.Wait();
  EXPECT_EQ(d.result.finish, FinishReason::kStop);
  EXPECT_EQ(d.tokens.back(), expected[5]);
}

TEST_F(EngineTest, SessionsSurviveMemoryPressureWithIdenticalOutput) {
  // Tier 0 holds 12 pages (192 tokens); ten 60-token sessions need 40.
  Build(/*tier0_pages=*/12, /*tier1_pages=*/64);
  std::vector<std::vector<int32_t>> contexts;
  for (int i = 0; i < 10; ++i) {
    Collector c;
    auto p = Prompt(50, i);
    ASSERT_TRUE(engine_->Submit(Req("s" + std::to_string(i), RequestMode::kFullContext, p, 6), &c).ok());
    c.Wait();
    ASSERT_TRUE(c.status.ok()) << c.status;
    ASSERT_EQ(c.tokens, Expected(p, 6));
    p.insert(p.end(), c.tokens.begin(), c.tokens.end());
    contexts.push_back(p);
  }
  EXPECT_GT(kv_->GetStats().offloads, 0);
  int64_t restored = 0;
  for (int i = 0; i < 10; ++i) {
    Collector c;
    auto more = Prompt(4, 100 + i);
    ASSERT_TRUE(engine_->Submit(Req("s" + std::to_string(i), RequestMode::kAppend, more, 5), &c).ok());
    c.Wait();
    ASSERT_TRUE(c.status.ok()) << c.status;
    auto full = contexts[i];
    full.insert(full.end(), more.begin(), more.end());
    EXPECT_EQ(c.tokens, Expected(full, 5)) << "session " << i;
    restored += c.result.restored_tokens;
    ASSERT_TRUE(kv_->CheckInvariants().ok());
  }
  EXPECT_GT(restored, 0);
  for (int i = 0; i < 10; ++i) EXPECT_TRUE(engine_->CloseSession("s" + std::to_string(i), "t").ok());
  auto stats = kv_->GetStats();
  EXPECT_EQ(stats.tier[0].session_private_pages + stats.tier[0].prefix_shared_pages, 0);
  EXPECT_EQ(stats.tier[1].session_private_pages, 0);
}

TEST_F(EngineTest, TenantLimitsAnswerResourceExhausted) {
  EngineOptions o;
  o.tenant_limits.max_sessions = 2;
  o.tenant_limits.max_requests = 1;
  o.tenant_limits.max_pinned_pages = 3;
  Build(/*tier0_pages=*/64, /*tier1_pages=*/64, o);
  // Requests in flight: the second concurrent request of a tenant is refused;
  // another tenant is not affected.
  absl::Notification gate;
  runner_->gate_ = &gate;
  Collector a, b, c;
  ASSERT_TRUE(engine_->Submit(Req("", RequestMode::kFullContext, Prompt(5), 2, "t1"), &a).ok());
  auto st = engine_->Submit(Req("", RequestMode::kFullContext, Prompt(5), 2, "t1"), &b);
  EXPECT_EQ(st.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(st.status().message().find("t1"), absl::string_view::npos);
  ASSERT_TRUE(engine_->Submit(Req("", RequestMode::kFullContext, Prompt(5), 2, "t2"), &c).ok());
  gate.Notify();
  a.Wait();
  c.Wait();
  runner_->gate_ = nullptr;
  // Sessions: two named sessions, the third is refused.
  for (const char* id : {"s1", "s2"}) {
    Collector x;
    ASSERT_TRUE(engine_->Submit(Req(id, RequestMode::kFullContext, Prompt(20), 2, "t1"), &x).ok());
    x.Wait();
  }
  Collector y;
  EXPECT_EQ(engine_->Submit(Req("s3", RequestMode::kFullContext, Prompt(20), 2, "t1"), &y).status().code(),
            absl::StatusCode::kResourceExhausted);
  // Pinned pages: s1 holds 2 pages (21 tokens), pinning s2 too would make 4 > 3.
  ASSERT_TRUE(engine_->SetPinned("s1", "t1", true).ok());
  EXPECT_EQ(engine_->SetPinned("s2", "t1", true).code(), absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(engine_->SetPinned("s1", "t1", false).ok());
  EXPECT_TRUE(engine_->SetPinned("s2", "t1", true).ok());
}

TEST_F(EngineTest, ForkCopiesContext) {
  Collector a;
  auto p = Prompt(30);
  ASSERT_TRUE(engine_->Submit(Req("a", RequestMode::kFullContext, p, 4), &a).ok());
  a.Wait();
  ASSERT_TRUE(engine_->ForkSession("a", "b", "t").ok());
  EXPECT_EQ(engine_->ForkSession("a", "b", "t").code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(*engine_->Context("b"), *engine_->Context("a"));
  Collector x, y;
  ASSERT_TRUE(engine_->Submit(Req("a", RequestMode::kAppend, Prompt(3, 1), 4), &x).ok());
  x.Wait();
  ASSERT_TRUE(engine_->Submit(Req("b", RequestMode::kAppend, Prompt(3, 1), 4), &y).ok());
  y.Wait();
  EXPECT_EQ(x.tokens, y.tokens);
}

}  // namespace
}  // namespace kvcache::sched
