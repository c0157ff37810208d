// Engine scheduling tests against the pure-logic model of fake_runner.h.
#include "worker/sched/engine.h"

#include <atomic>
#include <cstring>
#include <thread>

#include "absl/strings/str_replace.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/worker/sched/fake_runner.h"

namespace kvcache::sched {
namespace {

class EngineTest : public ::testing::Test {
 protected:
  void SetUp() override { Build(/*tier0_pages=*/64, /*tier1_pages=*/64); }

  void Build(int tier0_pages, int tier1_pages, EngineOptions options = {}) {
    engine_.reset();
    auto bed = MakeEngineBed(tier0_pages, tier1_pages, options);
    ASSERT_TRUE(bed.ok()) << bed.status();
    tokenizer_ = std::move(bed->tokenizer);
    kv_ = std::move(bed->kv);
    runner_ = std::move(bed->runner);
    engine_ = std::move(bed->engine);
  }

  void TearDown() override {
    engine_.reset();
    if (kv_) {
      EXPECT_TRUE(kv_->CheckInvariants().ok()) << kv_->CheckInvariants();
    }
  }

  // Exports session `id` whole, as a migration's source does, and hands it
  // over: it leaves this engine. Empty (a test failure) when the export fails.
  std::vector<kv::KvChunk> ExportAway(const std::string& id) {
    std::vector<kv::KvChunk> chunks;
    auto exporter = engine_->BeginExport(id, "t", kv::ExportOptions{});
    EXPECT_TRUE(exporter.ok()) << exporter.status();
    if (!exporter.ok()) return chunks;
    kv::KvChunk chunk;
    while (*(*exporter)->NextBulk(&chunk)) chunks.push_back(chunk);
    while (*(*exporter)->NextFinal(&chunk)) chunks.push_back(chunk);
    exporter->reset();
    engine_->EndExport(id, "t", /*handed_to=*/"w2");
    return chunks;
  }

  // An importer fed every chunk (staged, not yet adopted: FinishImport).
  std::unique_ptr<kv::SessionImporter> StageImport(const std::vector<kv::KvChunk>& chunks) {
    auto importer = engine_->BeginImport();
    EXPECT_TRUE(importer.ok()) << importer.status();
    if (!importer.ok()) return nullptr;
    for (const kv::KvChunk& chunk : chunks) EXPECT_TRUE((*importer)->Add(chunk).ok());
    return std::move(*importer);
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

  // Req with seeded sampling at temperature 1 that ignores EOS: a stream whose
  // tokens depend on where the sampler's sequence is.
  GenerateRequest Seeded(const std::string& session, RequestMode mode, std::vector<int32_t> input,
                         int max_tokens) {
    GenerateRequest r = Req(session, mode, std::move(input), max_tokens);
    r.sampling = model::SamplingConfig{1.0f, 0, 1.0f, 42};
    r.ignore_eos = true;
    return r;
  }

  // Submits `r` and waits for it to end OK.
  void RunOk(const GenerateRequest& r, Collector* c) {
    ASSERT_TRUE(engine_->Submit(r, c).ok());
    c->Wait();
    ASSERT_TRUE(c->status.ok()) << c->status;
  }

  // Submits a 50-token FULL_CONTEXT request on `session` and returns once the
  // engine thread is inside the request's third step (two tokens out), held
  // there until runner_->LimitSteps(-1).
  absl::StatusOr<uint64_t> SubmitHeldInItsThirdStep(const std::string& session, Collector* c) {
    const int s0 = runner_->steps();
    runner_->LimitSteps(s0 + 2);
    auto id = engine_->Submit(Req(session, RequestMode::kFullContext, Prompt(20), 50), c);
    if (id.ok()) runner_->WaitForEntered(s0 + 3);
    return id;
  }

  // Resends turn 2 (Prompt(3, 7)) to session "s" with tokens_read = 0, and
  // expects it to continue turn 1 (Prompt(20) and `first`'s reply) with it once.
  void ExpectRetryWithNoTokenReadContinues(const Collector& first) {
    GenerateRequest retry = Req("s", RequestMode::kAppend, Prompt(3, 7), 3);
    retry.tokens_read = 0;
    Collector c;
    ASSERT_TRUE(engine_->Submit(retry, &c).ok());
    c.Wait();
    ASSERT_TRUE(c.status.ok()) << c.status;
    std::vector<int32_t> seen = Prompt(20);
    seen.insert(seen.end(), first.tokens.begin(), first.tokens.end());
    for (int32_t t : Prompt(3, 7)) seen.push_back(t);
    EXPECT_EQ(c.result.prompt_tokens, static_cast<int64_t>(seen.size()));
    EXPECT_EQ(c.tokens, Expected(seen, 3));
  }

  // Session "s": turn 1, FULL_CONTEXT Prompt(20) with a 4-token reply (`first`),
  // then turn 2, APPEND Prompt(2, 9) with a 3-token reply (`second`).
  void TwoTurns(Collector* first, Collector* second) {
    ASSERT_TRUE(engine_->Submit(Req("s", RequestMode::kFullContext, Prompt(20), 4), first).ok());
    first->Wait();
    ASSERT_TRUE(first->status.ok()) << first->status;
    ASSERT_TRUE(engine_->Submit(Req("s", RequestMode::kAppend, Prompt(2, 9), 3), second).ok());
    second->Wait();
    ASSERT_TRUE(second->status.ok()) << second->status;
    ASSERT_EQ(second->tokens.size(), 3u);
  }

  // Submits `r` while session "other" holds the only running slot (an engine
  // built with max_running = 1) and cancels it there: it ends in the queue,
  // before its first token. Returns once both requests ended.
  void CancelInTheQueue(const GenerateRequest& r) {
    const int s0 = runner_->steps();
    runner_->LimitSteps(s0 + 1);
    Collector running, queued;
    ASSERT_TRUE(engine_->Submit(Req("other", RequestMode::kFullContext, Prompt(9), 20), &running).ok());
    runner_->WaitForEntered(s0 + 2);  // "other" holds the only running slot
    auto id = engine_->Submit(r, &queued);
    ASSERT_TRUE(id.ok()) << id.status();
    engine_->Cancel(*id);
    runner_->LimitSteps(-1);
    queued.Wait();
    EXPECT_EQ(queued.status.code(), absl::StatusCode::kCancelled);
    EXPECT_TRUE(queued.tokens.empty());
    running.Wait();
  }

  // A fresh engine whose steps hold one decode and two pages of prompt (33
  // tokens, no step-time target): with a request held in a step
  // (SubmitHeldInItsThirdStep), the order of prompts shows step by step.
  void BuildWithTwoPagesOfPromptPerStep() {
    EngineOptions o;
    o.max_batch_tokens = 33;
    o.max_step_time = absl::Milliseconds(-1);
    Build(/*tier0_pages=*/64, /*tier1_pages=*/64, o);
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

// Each step's statistics carry the runner's split of its forward pass, and the
// forward pass is part of the step.
TEST_F(EngineTest, StepStatsCarryTheRunnersSplitOfTheForwardPass) {
  runner_->profile_ = {absl::Milliseconds(3), absl::Milliseconds(1)};
  absl::Mutex mu;
  std::vector<StepStats> steps;
  engine_->SetStepCallback([&](const StepStats& s) {
    absl::MutexLock lock(&mu);
    steps.push_back(s);
  });
  Collector c;
  ASSERT_TRUE(engine_->Submit(Req("", RequestMode::kFullContext, Prompt(20), 4), &c).ok());
  c.Wait();
  ASSERT_TRUE(c.status.ok()) << c.status;
  ASSERT_TRUE(engine_->WaitIdle(absl::Seconds(10)));
  engine_->SetStepCallback(nullptr);
  absl::MutexLock lock(&mu);
  ASSERT_GE(steps.size(), 4u);  // a prefill, then a decode per further token
  for (const StepStats& s : steps) {
    EXPECT_EQ(s.products, absl::Milliseconds(3));
    EXPECT_EQ(s.attention, absl::Milliseconds(1));
    EXPECT_GT(s.forward, absl::ZeroDuration());
    EXPECT_LE(s.forward, s.duration);
  }
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

// A seeded request samples the same tokens alone and in a batch whose tokens are
// sampled on several threads in any order (Runner::ParallelFor): each request
// owns its sampler.
TEST_F(EngineTest, SampledTokensDoNotDependOnTheBatchOrItsThreads) {
  constexpr int kRequests = 4, kTokens = 12;
  auto req = [this](int i) {
    GenerateRequest r = Req("", RequestMode::kFullContext, Prompt(5, i), kTokens);
    r.sampling = model::SamplingConfig{1.0f, 0, 1.0f, static_cast<uint64_t>(100 + i)};
    r.ignore_eos = true;
    return r;
  };
  std::vector<std::vector<int32_t>> alone;
  for (int i = 0; i < kRequests; ++i) {
    Collector c;
    ASSERT_TRUE(engine_->Submit(req(i), &c).ok());
    c.Wait();
    ASSERT_TRUE(c.status.ok()) << c.status;
    ASSERT_EQ(c.tokens.size(), static_cast<size_t>(kTokens));
    alone.push_back(c.tokens);
  }
  EXPECT_NE(alone[0], Expected(Prompt(5, 0), kTokens)) << "temperature 1 should not follow the argmax";
  runner_->threaded_parallel_for_ = true;
  runner_->LimitSteps(runner_->steps());
  std::vector<Collector> together(kRequests);
  for (int i = 0; i < kRequests; ++i) ASSERT_TRUE(engine_->Submit(req(i), &together[i]).ok());
  runner_->LimitSteps(-1);
  for (int i = 0; i < kRequests; ++i) {
    together[i].Wait();
    ASSERT_TRUE(together[i].status.ok()) << together[i].status;
    EXPECT_EQ(together[i].tokens, alone[i]) << "request " << i;
  }
  EXPECT_EQ(runner_->max_sequences_, kRequests);
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
            absl::StatusCode::kOutOfRange);  // over the 512-token model context
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

// A prompt that fills tier 0 exactly is served: its first token needs no page
// and ends it (CONTEXT_FULL). It used to be refused OUT_OF_RANGE, one token
// short of the boundary, with a page count one too many.
TEST_F(EngineTest, PromptLargerThanTier0IsOutOfRange) {
  Build(/*tier0_pages=*/4, /*tier1_pages=*/4);  // 64 tokens of 16-token pages
  Collector c;
  EXPECT_EQ(engine_->Submit(Req("", RequestMode::kFullContext, Prompt(100), 3), &c).status().code(),
            absl::StatusCode::kOutOfRange);
  absl::Status over = engine_->Submit(Req("", RequestMode::kFullContext, Prompt(65), 3), &c).status();
  EXPECT_EQ(over.code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(std::string(over.message()),
              ::testing::StartsWith(kContextOverTier0Message));  // a router moves on it
  EXPECT_THAT(over.message(), ::testing::HasSubstr("need 5 KV pages"));
  Collector full;
  ASSERT_TRUE(engine_->Submit(Req("", RequestMode::kFullContext, Prompt(64), 3), &full).ok());
  full.Wait();
  ASSERT_TRUE(full.status.ok()) << full.status;
  EXPECT_EQ(full.result.finish, FinishReason::kContextFull);
  EXPECT_EQ(full.tokens, Expected(Prompt(64), 1));
}

// A request that leaves max_tokens to the server gets no more than the
// per-request limit, whatever the default says.
TEST_F(EngineTest, TheDefaultMaxTokensObeysThePerRequestLimit) {
  EngineOptions o;
  o.default_max_tokens = 256;
  o.max_tokens_per_request = 5;
  Build(/*tier0_pages=*/64, /*tier1_pages=*/64, o);
  Collector c;
  ASSERT_TRUE(engine_->Submit(Req("", RequestMode::kFullContext, Prompt(10), 0), &c).ok());
  c.Wait();
  ASSERT_TRUE(c.status.ok()) << c.status;
  EXPECT_EQ(c.result.finish, FinishReason::kLength);
  EXPECT_EQ(c.tokens.size(), 5u);
}

// A request alone whose context outgrows tier 0 ends as at --max_context: OK,
// CONTEXT_FULL, its tokens kept by the client and by the session alike.
TEST_F(EngineTest, ContextOutgrowingTier0EndsAtContextFullWhenAlone) {
  Build(/*tier0_pages=*/4, /*tier1_pages=*/4);  // 64 tokens of 16-token pages
  Collector c;
  const auto prompt = Prompt(40);
  ASSERT_TRUE(engine_->Submit(Req("long", RequestMode::kFullContext, prompt, 100), &c).ok());
  const GenerateResult& r = c.Wait();
  ASSERT_TRUE(c.status.ok()) << c.status;
  EXPECT_EQ(r.finish, FinishReason::kContextFull);
  // 64 tokens fill the 4 pages; the last token sampled needs a fifth.
  EXPECT_EQ(c.tokens.size(), 25u);
  EXPECT_EQ(c.tokens, Expected(prompt, static_cast<int>(c.tokens.size())));
  auto context = engine_->Context("long", "t");
  ASSERT_TRUE(context.ok()) << context.status();
  EXPECT_EQ(context->size(), prompt.size() + c.tokens.size());

  // The session goes on from there in a later turn only as far as tier 0 allows:
  // an APPEND that does not fit is refused before it starts.
  Collector more;
  EXPECT_EQ(engine_->Submit(Req("long", RequestMode::kAppend, Prompt(3), 5), &more).status().code(),
            absl::StatusCode::kOutOfRange);
}

// Two requests that each outgrow tier 0 end as each does alone (OK,
// CONTEXT_FULL, the same tokens), instead of taking the tier from each other in
// turn: each preempted the other to recompute its context, and neither grew
// (a livelock that only a deadline or a disconnect ended).
TEST_F(EngineTest, RequestsOutgrowingTier0TogetherEachEndAtContextFull) {
  Build(/*tier0_pages=*/4, /*tier1_pages=*/0);  // 64 tokens; no tier 1 to offload to
  const auto p1 = Prompt(40), p2 = Prompt(40, 3);
  Collector a, b;
  GenerateRequest ra = Req("a", RequestMode::kFullContext, p1, 100);
  GenerateRequest rb = Req("b", RequestMode::kFullContext, p2, 100);
  ra.deadline = rb.deadline = absl::Now() + absl::Seconds(30);  // the livelock ends here, failing
  ASSERT_TRUE(engine_->Submit(ra, &a).ok());
  ASSERT_TRUE(engine_->Submit(rb, &b).ok());
  for (Collector* c : {&a, &b}) {
    const GenerateResult& r = c->Wait();
    ASSERT_TRUE(c->status.ok()) << c->status;
    EXPECT_EQ(r.finish, FinishReason::kContextFull);
    EXPECT_EQ(c->tokens.size(), 25u);  // as alone: 65 tokens need a fifth page
  }
  EXPECT_EQ(a.tokens, Expected(p1, 25));
  EXPECT_EQ(b.tokens, Expected(p2, 25));
}

// A request alone whose context would fit tier 0, but which a pinned session
// leaves no page to grow into, fails RESOURCE_EXHAUSTED mid-stream (its tokens
// stand, and the session keeps them), not OK with CONTEXT_FULL: that reads as a
// reply that reached the worker's context limit, while another worker (or this
// one later) can continue it. A black-box drain test saw such replies cut at
// 16-19 pages of a 32-page tier 0 while idle sessions moved in.
TEST_F(EngineTest, RequestBlockedByPinnedPagesFailsResourceExhaustedNotContextFull) {
  Build(/*tier0_pages=*/4, /*tier1_pages=*/0);  // 64 tokens of 16-token pages
  Collector pinned;
  GenerateRequest fill = Req("pinned", RequestMode::kFullContext, Prompt(40), 1);
  fill.pin = true;  // 41 tokens: 3 pages, kept in tier 0
  ASSERT_TRUE(engine_->Submit(fill, &pinned).ok());
  pinned.Wait();
  ASSERT_TRUE(pinned.status.ok()) << pinned.status;
  Collector c;
  const auto prompt = Prompt(10, 1);
  ASSERT_TRUE(engine_->Submit(Req("grows", RequestMode::kFullContext, prompt, 40), &c).ok());
  c.Wait();
  EXPECT_EQ(c.status.code(), absl::StatusCode::kResourceExhausted) << c.status;
  // The K/V of its first 16 tokens fill its page; the 7th sampled token's
  // needs a second, which the pin holds.
  EXPECT_EQ(c.tokens.size(), 7u);
  EXPECT_EQ(c.tokens, Expected(prompt, static_cast<int>(c.tokens.size())));
  auto context = engine_->Context("grows", "t");
  ASSERT_TRUE(context.ok()) << context.status();
  EXPECT_EQ(context->size(), prompt.size() + c.tokens.size());
}

// A request that would have created its session and failed before its first
// token leaves no session: it would hold one of the tenant's slots for nothing.
TEST_F(EngineTest, NewSessionRefusedForMemoryLeavesNoSession) {
  Build(/*tier0_pages=*/4, /*tier1_pages=*/0);
  Collector pinned;
  GenerateRequest fill = Req("pinned", RequestMode::kFullContext, Prompt(60), 1);
  fill.pin = true;  // 61 tokens: all 4 pages, kept in tier 0
  ASSERT_TRUE(engine_->Submit(fill, &pinned).ok());
  pinned.Wait();
  ASSERT_TRUE(pinned.status.ok()) << pinned.status;
  Collector refused;
  ASSERT_TRUE(engine_->Submit(Req("new", RequestMode::kFullContext, Prompt(10, 1), 3), &refused).ok());
  refused.Wait();
  EXPECT_EQ(refused.status.code(), absl::StatusCode::kResourceExhausted) << refused.status;
  for (const kv::SessionName& n : engine_->Sessions()) EXPECT_NE(n.id, "new");
  EXPECT_FALSE(kv_->GetSession(kv::SessionKey("t", "new")).ok());
  EXPECT_TRUE(engine_->Context("pinned", "t").ok());
}

// A session resent with a longer prompt takes the pages of it that another
// request cached, as a new session would, beyond what it held itself.
TEST_F(EngineTest, FullContextOnASessionTakesCachedPagesBeyondItsOwn) {
  const auto p1 = Prompt(33);
  auto p2 = p1;
  for (int i = 0; i < 21; ++i) p2.push_back(kFirstByteToken + 'a' + i);
  Collector first, other, again;
  ASSERT_TRUE(engine_->Submit(Req("a", RequestMode::kFullContext, p1, 1), &first).ok());
  first.Wait();
  ASSERT_TRUE(first.status.ok()) << first.status;
  ASSERT_TRUE(engine_->Submit(Req("", RequestMode::kFullContext, p2, 1), &other).ok());
  EXPECT_EQ(other.Wait().cached_tokens, 32);  // a's two full pages
  const GenerateResult& r = [&]() -> const GenerateResult& {
    EXPECT_TRUE(engine_->Submit(Req("a", RequestMode::kFullContext, p2, 4), &again).ok());
    return again.Wait();
  }();
  ASSERT_TRUE(again.status.ok()) << again.status;
  EXPECT_EQ(r.cached_tokens, 48) << "a kept its 33 tokens and computed the rest again";
  EXPECT_EQ(again.tokens, Expected(p2, 4));
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

// A client cancels after reading some tokens while the engine is computing the
// next one: that token reaches nobody, so the session must not keep it either
// (the next APPEND would continue from a token the client never saw). The same
// for a drain that cuts the stream (CutRequests), with its own status.
TEST_F(EngineTest, TokenOfTheStepDuringWhichARequestIsCancelledIsNeitherSentNorKept) {
  for (bool cut : {false, true}) {
    SCOPED_TRACE(cut ? "CutRequests" : "Cancel");
    const std::string sid = cut ? "cut" : "cancelled";
    Collector c;
    auto id = SubmitHeldInItsThirdStep(sid, &c);
    ASSERT_TRUE(id.ok()) << id.status();
    if (cut) {
      EXPECT_EQ(engine_->CutRequests(absl::UnavailableError("draining")), 1);
    } else {
      engine_->Cancel(*id);
    }
    runner_->LimitSteps(-1);
    c.Wait();
    EXPECT_EQ(c.status.code(), cut ? absl::StatusCode::kUnavailable : absl::StatusCode::kCancelled);
    ASSERT_EQ(c.tokens.size(), 2u);
    std::vector<int32_t> seen = Prompt(20);
    seen.insert(seen.end(), c.tokens.begin(), c.tokens.end());
    EXPECT_EQ(*engine_->Context(sid, "t"), seen);
    // The conversation goes on from what the client saw.
    Collector next;
    ASSERT_TRUE(engine_->Submit(Req(sid, RequestMode::kAppend, Prompt(3, 7), 3), &next).ok());
    next.Wait();
    ASSERT_TRUE(next.status.ok()) << next.status;
    for (int32_t t : Prompt(3, 7)) seen.push_back(t);
    EXPECT_EQ(next.tokens, Expected(seen, 3));
  }
  ASSERT_TRUE(engine_->WaitIdle(absl::Seconds(10)));
  EXPECT_EQ(engine_->tracked_request_ids(), 0u);
}

// "Stop generating", then the next message at once: the new request waits for
// the cancelled one to end (a step away) instead of failing with ABORTED, and
// continues the conversation the client saw. (The second Submit races the
// release of the held step: it waits, or finds the session free; either way it
// must succeed, where it used to fail with ABORTED whenever it came first.)
TEST_F(EngineTest, RequestAfterACancelWaitsForTheCancelledOneInsteadOfAborted) {
  Collector first;
  auto id = SubmitHeldInItsThirdStep("s", &first);
  ASSERT_TRUE(id.ok()) << id.status();
  Collector busy;  // not cancelled: the session is busy, after the cancel grace (100 ms)
  const absl::Time asked = absl::Now();
  EXPECT_EQ(engine_->Submit(Req("s", RequestMode::kAppend, Prompt(3, 7), 3), &busy).status().code(),
            absl::StatusCode::kAborted);
  EXPECT_GE(absl::Now() - asked, absl::Milliseconds(95));  // a cancel may still be on its way
  engine_->Cancel(*id);
  Collector next;
  absl::StatusOr<uint64_t> next_id;
  std::thread submit(
      [&] { next_id = engine_->Submit(Req("s", RequestMode::kAppend, Prompt(3, 7), 3), &next); });
  runner_->LimitSteps(-1);  // the cancelled request's step ends, and with it the request
  submit.join();
  ASSERT_TRUE(next_id.ok()) << next_id.status();
  first.Wait();
  EXPECT_EQ(first.status.code(), absl::StatusCode::kCancelled);
  next.Wait();
  ASSERT_TRUE(next.status.ok()) << next.status;
  std::vector<int32_t> seen = Prompt(20);
  seen.insert(seen.end(), first.tokens.begin(), first.tokens.end());
  for (int32_t t : Prompt(3, 7)) seen.push_back(t);
  EXPECT_EQ(next.tokens, Expected(seen, 3));
}

// "Stop generating", then the next message, which reaches the worker before
// the cancel does (a loaded worker, a router in between): an APPEND that sets
// tokens_read says it follows a cancel, and waits for it past kCancelGrace.
TEST_F(EngineTest, AppendWithTokensReadWaitsForALateCancel) {
  Collector first;
  auto id = SubmitHeldInItsThirdStep("s", &first);
  ASSERT_TRUE(id.ok()) << id.status();
  GenerateRequest req = Req("s", RequestMode::kAppend, Prompt(3, 7), 3);
  req.tokens_read = 1;
  Collector next;
  absl::StatusOr<uint64_t> next_id;
  std::atomic<bool> returned{false};
  std::thread submit([&] {
    next_id = engine_->Submit(req, &next);
    returned = true;
  });
  // The cancel arrives well after the 100 ms grace. (A slow thread start only
  // makes this weaker: it cannot fail with the wait in place.)
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_FALSE(returned) << next_id.status();
  engine_->Cancel(*id);
  runner_->LimitSteps(-1);
  submit.join();
  ASSERT_TRUE(next_id.ok()) << next_id.status();
  first.Wait();
  EXPECT_EQ(first.status.code(), absl::StatusCode::kCancelled);
  ASSERT_GE(first.tokens.size(), 1u);
  next.Wait();
  ASSERT_TRUE(next.status.ok()) << next.status;
  std::vector<int32_t> seen = Prompt(20);
  seen.push_back(first.tokens[0]);
  for (int32_t t : Prompt(3, 7)) seen.push_back(t);
  EXPECT_EQ(next.tokens, Expected(seen, 3));
}

// "Stop generating, then close": a session call right after a cancel waits for
// the cancelled request to end instead of answering ABORTED. (Like the test
// above, it races the release of the step, so it does not always wait.)
TEST_F(EngineTest, SessionCallAfterACancelWaitsForTheCancelledRequest) {
  Collector first;
  auto id = SubmitHeldInItsThirdStep("s", &first);
  ASSERT_TRUE(id.ok()) << id.status();
  engine_->Cancel(*id);
  absl::Status closed;
  std::thread close([&] { closed = engine_->CloseSession("s", "t"); });
  runner_->LimitSteps(-1);
  close.join();
  EXPECT_TRUE(closed.ok()) << closed;
  first.Wait();
  EXPECT_EQ(first.status.code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(engine_->View("s", "t").status().code(), absl::StatusCode::kNotFound);
}

// A tenant at its request quota whose queued request passed its deadline may
// send the next one at once: the dead one's quota is already given back, though
// the engine thread removes it from the queue only at its next turn.
TEST_F(EngineTest, QueuedRequestPastItsDeadlineGivesBackItsQuotaAtOnce) {
  EngineOptions o;
  o.max_running = 1;
  o.tenant_limits.max_requests = 2;
  Build(/*tier0_pages=*/64, /*tier1_pages=*/64, o);
  const int s0 = runner_->steps();
  runner_->LimitSteps(s0 + 1);
  Collector running, queued, next;
  ASSERT_TRUE(engine_->Submit(Req("a", RequestMode::kFullContext, Prompt(20), 50), &running).ok());
  runner_->WaitForEntered(s0 + 2);  // the engine thread is inside a step
  GenerateRequest late = Req("b", RequestMode::kFullContext, Prompt(5), 3);
  late.deadline = absl::Now() + absl::Milliseconds(1);
  ASSERT_TRUE(engine_->Submit(late, &queued).ok());
  while (absl::Now() <= late.deadline) std::this_thread::yield();
  // The engine thread is still in its step: "b" is in the queue, past its deadline.
  auto id = engine_->Submit(Req("c", RequestMode::kFullContext, Prompt(5), 3), &next);
  EXPECT_TRUE(id.ok()) << id.status();
  runner_->LimitSteps(-1);
  queued.Wait();
  EXPECT_EQ(queued.status.code(), absl::StatusCode::kDeadlineExceeded);
  running.Wait();
  if (id.ok()) next.Wait();
}

// "Stop generating", then a new request: a tenant at its request quota whose
// running request was cancelled may send the next one at once, though the
// cancelled one leaves only at the engine's next step boundary. The cancel
// travels apart from the client's next request and may land just after it:
// a request at the limit waits for it (kCancelGrace), as a session's next
// request does, instead of RESOURCE_EXHAUSTED. First the cancel lands before
// the request, then the two race from the same moment, twenty times, so that
// the cancel comes second in some of them.
TEST_F(EngineTest, CancelledRunningRequestGivesBackItsQuotaAtOnce) {
  EngineOptions o;
  o.tenant_limits.max_requests = 1;
  Build(/*tier0_pages=*/64, /*tier1_pages=*/64, o);
  // Submits "a" and holds it inside a step.
  auto start_running = [&](Collector* running) {
    const int s0 = runner_->steps();
    runner_->LimitSteps(s0 + 1);
    auto id = engine_->Submit(Req("a", RequestMode::kFullContext, Prompt(20), 50), running);
    if (id.ok()) runner_->WaitForEntered(s0 + 2);
    return id;
  };
  {
    Collector running, next;
    auto id = start_running(&running);
    ASSERT_TRUE(id.ok()) << id.status();
    // At its limit with nothing leaving: refused (after the wait).
    EXPECT_EQ(engine_->Submit(Req("b", RequestMode::kFullContext, Prompt(5), 3), &next).status().code(),
              absl::StatusCode::kResourceExhausted);
    engine_->Cancel(*id);
    auto again = engine_->Submit(Req("b", RequestMode::kFullContext, Prompt(5), 3), &next);
    EXPECT_TRUE(again.ok()) << again.status();
    runner_->LimitSteps(-1);
    running.Wait();
    EXPECT_EQ(running.status.code(), absl::StatusCode::kCancelled);
    if (again.ok()) {
      next.Wait();
      EXPECT_TRUE(next.status.ok()) << next.status;
    }
  }
  for (int round = 0; round < 20; ++round) {
    Collector running, next;
    auto id = start_running(&running);
    ASSERT_TRUE(id.ok()) << id.status();
    absl::Notification go;
    std::thread canceller([&] {
      go.WaitForNotification();
      engine_->Cancel(*id);
    });
    go.Notify();
    auto again = engine_->Submit(Req("b", RequestMode::kFullContext, Prompt(5), 3), &next);
    canceller.join();
    EXPECT_TRUE(again.ok()) << "round " << round << ": " << again.status();
    runner_->LimitSteps(-1);
    running.Wait();
    if (again.ok()) next.Wait();
  }
}

// After a cancel the server may have sent tokens the client never read (in
// flight when it cancelled): an APPEND that says how many it read drops the
// rest of the last reply first, and the conversation is the one it saw.
TEST_F(EngineTest, AppendWithTokensReadDropsTheUnreadEndOfTheLastReply) {
  Collector first;
  ASSERT_TRUE(engine_->Submit(Req("s", RequestMode::kFullContext, Prompt(20), 6), &first).ok());
  first.Wait();
  ASSERT_EQ(first.tokens.size(), 6u);
  GenerateRequest too_many = Req("s", RequestMode::kAppend, Prompt(3, 7), 3);
  too_many.tokens_read = 7;
  Collector refused;
  EXPECT_EQ(engine_->Submit(too_many, &refused).status().code(), absl::StatusCode::kInvalidArgument);

  GenerateRequest next = Req("s", RequestMode::kAppend, Prompt(3, 7), 3);
  next.tokens_read = 2;  // the client read two of the six
  Collector c;
  ASSERT_TRUE(engine_->Submit(next, &c).ok());
  c.Wait();
  ASSERT_TRUE(c.status.ok()) << c.status;
  std::vector<int32_t> seen = Prompt(20);
  seen.insert(seen.end(), first.tokens.begin(), first.tokens.begin() + 2);
  for (int32_t t : Prompt(3, 7)) seen.push_back(t);
  EXPECT_EQ(c.tokens, Expected(seen, 3));
  EXPECT_EQ(c.result.prompt_tokens, static_cast<int64_t>(seen.size()));
  seen.insert(seen.end(), c.tokens.begin(), c.tokens.end());
  EXPECT_EQ(*engine_->Context("s", "t"), seen);
  EXPECT_EQ(engine_->View("s", "t")->last_reply_tokens, 3);

  // All of it read: nothing dropped. A fork keeps what its parent's last reply was.
  ASSERT_TRUE(engine_->ForkSession("s", "twin", "t").ok());
  EXPECT_EQ(engine_->View("twin", "t")->last_reply_tokens, 3);
  GenerateRequest all = Req("twin", RequestMode::kAppend, Prompt(2, 9), 2);
  all.tokens_read = 3;
  Collector d;
  ASSERT_TRUE(engine_->Submit(all, &d).ok());
  d.Wait();
  ASSERT_TRUE(d.status.ok()) << d.status;
  for (int32_t t : Prompt(2, 9)) seen.push_back(t);
  EXPECT_EQ(d.tokens, Expected(seen, 2));
}

// A turn cut after the worker sent tokens that never reached the client (a
// cancel or deadline while they were on their way): the client read none, so
// it resends its message with tokens_read = 0, and the session continues from
// before the cut turn, with the message once. Before, tokens_read = 0 dropped
// only the cut reply and the message was there twice.
TEST_F(EngineTest, AppendWithNoTokenReadUndoesTheCutRequestInputAndAll) {
  Collector first;
  ASSERT_TRUE(engine_->Submit(Req("s", RequestMode::kFullContext, Prompt(20), 4), &first).ok());
  first.Wait();
  ASSERT_TRUE(first.status.ok()) << first.status;
  const int s0 = runner_->steps();
  runner_->LimitSteps(s0 + 2);
  Collector cut;
  auto id = engine_->Submit(Req("s", RequestMode::kAppend, Prompt(3, 7), 50), &cut);
  ASSERT_TRUE(id.ok()) << id.status();
  runner_->WaitForEntered(s0 + 3);
  engine_->Cancel(*id);
  runner_->LimitSteps(-1);
  cut.Wait();
  EXPECT_EQ(cut.status.code(), absl::StatusCode::kCancelled);
  ASSERT_GE(cut.tokens.size(), 1u) << "the cut turn must have sent tokens (that its client never read)";
  EXPECT_EQ(engine_->View("s", "t")->last_request_tokens, 3 + static_cast<int64_t>(cut.tokens.size()));

  ExpectRetryWithNoTokenReadContinues(first);
}

// A turn cut in the queue, before it reached the session: it is still the
// session's last request, with an empty reply, so tokens_read = 0 drops
// nothing, and the reply before it, which the client read, stays. Before,
// tokens_read = 0 dropped that reply.
TEST_F(EngineTest, AppendWithNoTokenReadAfterARequestCutInTheQueueKeepsTheReplyBefore) {
  EngineOptions o;
  o.max_running = 1;
  Build(/*tier0_pages=*/64, /*tier1_pages=*/64, o);
  Collector first;
  ASSERT_TRUE(engine_->Submit(Req("s", RequestMode::kFullContext, Prompt(20), 4), &first).ok());
  first.Wait();
  ASSERT_TRUE(first.status.ok()) << first.status;
  ASSERT_NO_FATAL_FAILURE(CancelInTheQueue(Req("s", RequestMode::kAppend, Prompt(3, 7), 5)));

  // A positive tokens_read counts against the reply before it (4 tokens).
  GenerateRequest over = Req("s", RequestMode::kAppend, Prompt(3, 7), 3);
  over.tokens_read = 5;
  Collector refused;
  EXPECT_EQ(engine_->Submit(over, &refused).status().code(), absl::StatusCode::kInvalidArgument);
  ExpectRetryWithNoTokenReadContinues(first);
}

// Turn 1 (`first`), then turn 2 (Prompt(2, 9), 3 tokens), then a resend that
// replaces turn 2 (tokens_read = 0: its client read none of turn 2's reply),
// which ends before its first token: in the queue, or cancelled in its prefill
// (each path's end). A request that ended before its first token left the
// session as it was, but what its tokens_read dropped stands: the client cannot
// tell whether it reached the session, and resends with tokens_read = 0 again,
// so the session continues turn 1 without turn 2 either way. Before, the
// session kept turn 2 after an end in the queue or in prefill (qa20: 2-4 of 8
// black-box tries, by when the cancel landed) and dropped it after a reply cut
// with tokens on their way.
class EngineEndedEarlyTest : public EngineTest, public ::testing::WithParamInterface<bool> {};

TEST_P(EngineEndedEarlyTest, ARequestEndedBeforeItsFirstTokenStillDropsWhatItsTokensReadDropped) {
  const bool in_prefill = GetParam();
  EngineOptions o;
  o.max_running = 1;
  o.max_batch_tokens = 33;  // a prompt of 80 tokens takes three steps
  o.max_step_time = absl::Milliseconds(-1);
  Build(/*tier0_pages=*/64, /*tier1_pages=*/64, o);
  Collector first, second;
  ASSERT_NO_FATAL_FAILURE(TwoTurns(&first, &second));

  GenerateRequest resend = Req("s", RequestMode::kAppend, Prompt(80, 5), 5);
  resend.tokens_read = 0;
  if (in_prefill) {
    const int s0 = runner_->steps();
    runner_->LimitSteps(s0 + 1);
    Collector cut;
    auto id = engine_->Submit(resend, &cut);
    ASSERT_TRUE(id.ok()) << id.status();
    runner_->WaitForEntered(s0 + 2);  // its second prefill step
    engine_->Cancel(*id);
    runner_->LimitSteps(-1);
    cut.Wait();
    EXPECT_EQ(cut.status.code(), absl::StatusCode::kCancelled);
    ASSERT_TRUE(cut.tokens.empty());
  } else {
    ASSERT_NO_FATAL_FAILURE(CancelInTheQueue(resend));
  }
  // The session is as it was: the reply of turn 2 is still its last one.
  EXPECT_EQ(engine_->View("s", "t")->last_reply_tokens, 3);

  ExpectRetryWithNoTokenReadContinues(first);
}

INSTANTIATE_TEST_SUITE_P(InTheQueueOrInPrefill, EngineEndedEarlyTest, ::testing::Bool());

// What a request that ended before its first token dropped moves with its
// session (SessionView/ImportedState: SessionChunk.Commit's ended_early_*).
// Here it dropped nothing (tokens_read unset: its client read turn 2 whole), so
// a tokens_read = 0 after it keeps turn 2 on the new worker as on the old;
// without it, tokens_read = 0 there drops turn 2, as the last request.
TEST_F(EngineTest, AMovedSessionKeepsWhatARequestThatEndedEarlyDropped) {
  EngineOptions o;
  o.max_running = 1;
  Build(/*tier0_pages=*/64, /*tier1_pages=*/64, o);
  Collector first, second;
  ASSERT_NO_FATAL_FAILURE(TwoTurns(&first, &second));
  ASSERT_NO_FATAL_FAILURE(CancelInTheQueue(Req("s", RequestMode::kAppend, Prompt(4, 2), 3)));

  // Out and back in, as a migration between two workers carries it.
  const absl::StatusOr<SessionView> view = engine_->View("s", "t");
  ASSERT_TRUE(view.ok() && view->ended_early.has_value());
  EXPECT_EQ(view->ended_early->unread, 0);
  const std::vector<int32_t> context = *engine_->Context("s", "t");
  const std::vector<kv::KvChunk> chunks = ExportAway("s");
  ASSERT_FALSE(engine_->View("s", "t").ok());
  auto importer = StageImport(chunks);
  ASSERT_NE(importer, nullptr);
  ImportedState state;
  state.last_reply_tokens = view->last_reply_tokens;
  state.last_request_tokens = view->last_request_tokens;
  state.reply_open = view->reply_open;
  state.reply_open_before = view->reply_open_before;
  state.ended_early = view->ended_early;
  ASSERT_TRUE(engine_->FinishImport(*importer, context, state).ok());

  GenerateRequest next = Req("s", RequestMode::kAppend, Prompt(3, 7), 3);
  next.tokens_read = 0;
  Collector c;
  ASSERT_TRUE(engine_->Submit(next, &c).ok());
  c.Wait();
  ASSERT_TRUE(c.status.ok()) << c.status;
  std::vector<int32_t> seen = context;  // turn 2 and its reply stay
  for (int32_t t : Prompt(3, 7)) seen.push_back(t);
  EXPECT_EQ(c.result.prompt_tokens, static_cast<int64_t>(seen.size()));
  EXPECT_EQ(c.tokens, Expected(seen, 3));
}

// A pinned session moving in while a running request holds tier 0 is staged
// partly in tier 1, and pinning it would need a restore there is no room for
// now: a drain's move (unpin_over_quota) goes on unpinned, as over the pin
// quota, rather than lose the session; any other import is refused and leaves
// nothing.
TEST_F(EngineTest, APinnedSessionMovingOntoAHeldTier0ArrivesUnpinnedOnADrain) {
  Build(/*tier0_pages=*/4, /*tier1_pages=*/16);
  Collector first;
  ASSERT_TRUE(engine_->Submit(Req("m", RequestMode::kFullContext, Prompt(40, 1), 3), &first).ok());
  first.Wait();
  ASSERT_TRUE(first.status.ok()) << first.status;
  const std::vector<int32_t> context = *engine_->Context("m", "t");
  const std::vector<kv::KvChunk> chunks = ExportAway("m");
  Collector held;  // 2 of the 4 pages, in a step
  ASSERT_TRUE(SubmitHeldInItsThirdStep("hold", &held).ok());

  for (const bool drain : {false, true}) {
    SCOPED_TRACE(drain ? "a drain's move" : "an import");
    auto importer = StageImport(chunks);
    ASSERT_NE(importer, nullptr);
    ImportedState state;
    state.pinned = true;
    state.unpin_over_quota = drain;
    const absl::StatusOr<kv::SessionName> name = engine_->FinishImport(*importer, context, state);
    if (!drain) {
      EXPECT_EQ(name.status().code(), absl::StatusCode::kResourceExhausted) << name.status();
      EXPECT_FALSE(engine_->View("m", "t").ok());
      EXPECT_EQ(kv_->GetStats().tier[1].free_pages, 16);
      continue;
    }
    ASSERT_TRUE(name.ok()) << name.status();
    const kv::SessionInfo info = *kv_->GetSession(kv::SessionKey("t", "m"));
    EXPECT_FALSE(info.user_pinned);
    EXPECT_EQ(info.tier0_pages, 2);
    EXPECT_EQ(info.tier1_pages, 1);
  }
  runner_->LimitSteps(-1);
  held.Wait();
  Collector next;
  ASSERT_TRUE(engine_->Submit(Req("m", RequestMode::kAppend, Prompt(3, 7), 3), &next).ok());
  next.Wait();
  ASSERT_TRUE(next.status.ok()) << next.status;
  std::vector<int32_t> whole = context;
  for (int32_t t : Prompt(3, 7)) whole.push_back(t);
  EXPECT_EQ(next.tokens, Expected(whole, 3));
  EXPECT_EQ(next.result.cached_tokens, 42);  // all it cached (the last sampled token had no K/V)
}

// A router or client retries an APPEND that ended before its first token (a
// drain cut it, or it found no room) as it was sent, tokens_read included: the
// retry counts it against the same reply and continues the same conversation.
// Before, the first try made the session's last reply one of 0 tokens, and the
// retry failed INVALID_ARGUMENT ("tokens_read 2 exceeds the 0 tokens", qa20,
// after drains).
TEST_F(EngineTest, ARetryOfARequestThatEndedBeforeItsFirstTokenDoesWhatItWould) {
  EngineOptions o;
  o.max_running = 1;
  Build(/*tier0_pages=*/64, /*tier1_pages=*/64, o);
  Collector first, second;
  ASSERT_NO_FATAL_FAILURE(TwoTurns(&first, &second));

  GenerateRequest next = Req("s", RequestMode::kAppend, Prompt(3, 7), 3);
  next.tokens_read = 2;
  ASSERT_NO_FATAL_FAILURE(CancelInTheQueue(next));

  Collector retry;
  ASSERT_TRUE(engine_->Submit(next, &retry).ok());
  retry.Wait();
  ASSERT_TRUE(retry.status.ok()) << retry.status;
  std::vector<int32_t> seen = Prompt(20);
  seen.insert(seen.end(), first.tokens.begin(), first.tokens.end());
  for (int32_t t : Prompt(2, 9)) seen.push_back(t);
  seen.insert(seen.end(), second.tokens.begin(), second.tokens.begin() + 2);
  for (int32_t t : Prompt(3, 7)) seen.push_back(t);
  EXPECT_EQ(retry.result.prompt_tokens, static_cast<int64_t>(seen.size()));
  EXPECT_EQ(retry.tokens, Expected(seen, 3));
}

// Collects each token's text delta too.
class PieceCollector : public Collector {
 public:
  void OnToken(int32_t id, absl::string_view text) override {
    Collector::OnToken(id, text);
    pieces.emplace_back(text);
  }
  std::vector<std::string> pieces;
};

// A stream continued on another worker (GenerateRequest::continued: the
// router resends the prompt and the tokens already streamed) goes on as the
// uninterrupted one: a seeded sampling sequence, max_tokens, a stop string
// across the cut, and text that resumes where the client's left off (random
// byte tokens split characters). Before, the sampler started its sequence
// again, max_tokens counted afresh and the stop string was missed.
TEST_F(EngineTest, AContinuedStreamGoesOnAsTheUninterruptedOne) {
  auto seeded = [&](const std::string& session, std::vector<int32_t> input, int max_tokens) {
    return Seeded(session, RequestMode::kFullContext, std::move(input), max_tokens);
  };
  const std::vector<int32_t> prompt = Prompt(20);
  PieceCollector whole;
  RunOk(seeded("", prompt, 40), &whole);
  ASSERT_EQ(whole.tokens.size(), 40u);

  for (int k : {1, 17, 39, 40}) {
    SCOPED_TRACE(k);
    std::vector<int32_t> input = prompt;
    input.insert(input.end(), whole.tokens.begin(), whole.tokens.begin() + k);
    GenerateRequest r = seeded("c" + std::to_string(k), input, 40);
    r.continued = k;
    PieceCollector rest;
    RunOk(r, &rest);
    EXPECT_EQ(rest.result.finish, FinishReason::kLength);
    EXPECT_EQ(rest.tokens, std::vector<int32_t>(whole.tokens.begin() + k, whole.tokens.end()));
    std::string text;
    for (int i = 0; i < k; ++i) text += whole.pieces[i];
    EXPECT_EQ(text + rest.text_, whole.text_) << "a character the cut split is lost or repeated";
    // The session's last reply is the whole stream (tokens_read counts in it).
    EXPECT_EQ(engine_->View("c" + std::to_string(k), "t")->last_reply_tokens, 40);
  }

  // A stop string made of the texts of two tokens, cut between them: the first
  // pair whose text first occurs where they are.
  std::vector<size_t> ends;  // ends[i]: bytes of text after token i
  for (const std::string& piece : whole.pieces)
    ends.push_back((ends.empty() ? 0 : ends.back()) + piece.size());
  int k = 0;
  for (int i = 10; i < 40 && k == 0; ++i) {
    const std::string both = whole.pieces[i - 1] + whole.pieces[i];
    if (!whole.pieces[i - 1].empty() && !whole.pieces[i].empty() &&
        whole.text_.find(both) + both.size() == ends[i]) {
      k = i;
    }
  }
  ASSERT_GT(k, 0) << "no two adjacent tokens with text in this seed's output";
  GenerateRequest stop = seeded("", prompt, 40);
  stop.stop = {whole.pieces[k - 1] + whole.pieces[k]};
  PieceCollector stopped;
  RunOk(stop, &stopped);
  ASSERT_EQ(stopped.result.finish, FinishReason::kStopString);
  ASSERT_EQ(stopped.tokens.size(), static_cast<size_t>(k + 1));
  std::vector<int32_t> input = prompt;
  input.insert(input.end(), whole.tokens.begin(), whole.tokens.begin() + k);
  stop.input = input;
  stop.continued = k;
  PieceCollector rest;
  RunOk(stop, &rest);
  EXPECT_EQ(rest.result.finish, FinishReason::kStopString);
  EXPECT_EQ(rest.tokens, std::vector<int32_t>{whole.tokens[k]});

  // A stream whose continued tokens ended it already (its worker was lost
  // before the final message) ends at once, as it would have: here the stop
  // string, and EOS. It used to generate on.
  input.push_back(whole.tokens[k]);
  stop.input = input;
  stop.continued = k + 1;
  PieceCollector none;
  RunOk(stop, &none);
  EXPECT_EQ(none.result.finish, FinishReason::kStopString);
  EXPECT_TRUE(none.tokens.empty());
  GenerateRequest eos = seeded("", prompt, 40);
  eos.ignore_eos = false;
  eos.input.push_back(tokenizer_->eos_id());
  eos.continued = 1;
  PieceCollector after_eos;
  RunOk(eos, &after_eos);
  EXPECT_EQ(after_eos.result.finish, FinishReason::kStop);
  EXPECT_TRUE(after_eos.tokens.empty());

  // Out of range, or with APPEND: refused.
  GenerateRequest bad = seeded("", prompt, 4);
  bad.continued = 21;
  PieceCollector refused;
  EXPECT_EQ(engine_->Submit(bad, &refused).status().code(), absl::StatusCode::kInvalidArgument);
  bad = seeded("c1", prompt, 4);
  bad.mode = RequestMode::kAppend;
  bad.continued = 1;
  EXPECT_EQ(engine_->Submit(bad, &refused).status().code(), absl::StatusCode::kInvalidArgument);
}

// An APPEND whose reply was cut (out of room mid-reply, a drain's deadline)
// goes on where the client's stream stopped: the router sends the session,
// wherever it moved, an APPEND with no input and continued = the tokens its
// client has. The stream and the session end as the uninterrupted turn's: the
// same tokens, context and last request (tokens_read = 0 after it drops the
// cut turn and its continuation together). It names the cut request, and goes
// on no other's (ABORTED). Before, APPEND refused continued.
TEST_F(EngineTest, AnAppendGoesOnItsSessionsCutReply) {
  // The uninterrupted conversation: a turn, then an APPEND whose reply is 30 tokens.
  PieceCollector first, whole;
  RunOk(Seeded("whole", RequestMode::kFullContext, Prompt(20), 4), &first);
  RunOk(Seeded("whole", RequestMode::kAppend, Prompt(5, 3), 30), &whole);
  ASSERT_EQ(whole.tokens.size(), 30u);
  const SessionView want = *engine_->View("whole", "t");

  // Cut after `cut` tokens; the client has `has` of them (the rest never reached it).
  for (auto [cut, has] : {std::pair{1, 1}, {12, 12}, {12, 7}, {29, 29}}) {
    SCOPED_TRACE(absl::StrCat(cut, " cut, ", has, " read"));
    const std::string id = absl::StrCat("cut", cut, "_", has);
    PieceCollector one, two, rest;
    RunOk(Seeded(id, RequestMode::kFullContext, Prompt(20), 4), &one);
    GenerateRequest cut_turn = Seeded(id, RequestMode::kAppend, Prompt(5, 3), cut);
    cut_turn.request_id = "x-" + id;
    RunOk(cut_turn, &two);
    ASSERT_EQ(two.tokens.size(), static_cast<size_t>(cut));
    GenerateRequest on = Seeded(id, RequestMode::kAppend, {}, 30);
    on.continued = has;
    on.request_id = cut_turn.request_id;
    RunOk(on, &rest);
    EXPECT_EQ(rest.result.finish, FinishReason::kLength);
    EXPECT_EQ(rest.tokens, std::vector<int32_t>(whole.tokens.begin() + has, whole.tokens.end()));
    std::string text;
    for (int i = 0; i < has; ++i) text += whole.pieces[i];
    EXPECT_EQ(text + rest.text_, whole.text_);
    EXPECT_EQ(*engine_->Context(id, "t"), *engine_->Context("whole", "t"));
    const SessionView got = *engine_->View(id, "t");
    EXPECT_EQ(got.last_reply_tokens, want.last_reply_tokens);
    EXPECT_EQ(got.last_request_tokens, want.last_request_tokens);
    EXPECT_EQ(got.reply_open, want.reply_open);
    EXPECT_EQ(got.reply_open_before, want.reply_open_before);
  }

  // Refused, and the session left as it was: more than the last reply, an
  // input of its own, tokens_read besides, no request id; another request's.
  const std::vector<int32_t> before = *engine_->Context("cut12_7", "t");
  GenerateRequest bad = Seeded("cut12_7", RequestMode::kAppend, {}, 30);
  bad.continued = 31;
  bad.request_id = "x-cut12_7";
  PieceCollector refused;
  EXPECT_EQ(engine_->Submit(bad, &refused).status().code(), absl::StatusCode::kInvalidArgument);
  bad.continued = 3;
  bad.request_id = "x-cut1_1";
  EXPECT_EQ(engine_->Submit(bad, &refused).status().code(), absl::StatusCode::kAborted);
  bad.request_id.clear();
  EXPECT_EQ(engine_->Submit(bad, &refused).status().code(), absl::StatusCode::kInvalidArgument);
  bad.request_id = "x-cut12_7";
  bad.continued = 3;
  bad.input = Prompt(2);
  EXPECT_EQ(engine_->Submit(bad, &refused).status().code(), absl::StatusCode::kInvalidArgument);
  bad.input.clear();
  bad.tokens_read = 3;
  EXPECT_EQ(engine_->Submit(bad, &refused).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(*engine_->Context("cut12_7", "t"), before);

  // A cut reply, then another request on the session (a second client's turn):
  // the cut one cannot go on.
  PieceCollector three, other;
  GenerateRequest cut_turn = Seeded("cut12_7", RequestMode::kAppend, Prompt(5, 4), 6);
  cut_turn.request_id = "x-again";
  RunOk(cut_turn, &three);
  RunOk(Seeded("cut12_7", RequestMode::kAppend, Prompt(2, 5), 6), &other);
  const std::vector<int32_t> after_other = *engine_->Context("cut12_7", "t");
  GenerateRequest late = Seeded("cut12_7", RequestMode::kAppend, {}, 30);
  late.continued = 6;
  late.request_id = "x-again";
  EXPECT_EQ(engine_->Submit(late, &refused).status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(*engine_->Context("cut12_7", "t"), after_other);
}

// A client whose turn ended DEADLINE_EXCEEDED sends the next one at once; the
// engine thread has not yet seen the deadline (it is inside a step). The next
// request waits for the late one to leave, as it would for a cancelled one,
// instead of answering ABORTED after 100 ms.
TEST_F(EngineTest, ARequestAfterItsPredecessorsDeadlineWaitsForItInsteadOfAborting) {
  const int s0 = runner_->steps();
  runner_->LimitSteps(s0 + 2);
  Collector late;
  GenerateRequest req = Req("s", RequestMode::kFullContext, Prompt(20), 50);
  req.deadline = absl::Now() + absl::Milliseconds(30);
  ASSERT_TRUE(engine_->Submit(req, &late).ok());
  runner_->WaitForEntered(s0 + 3);
  while (absl::Now() <= req.deadline) std::this_thread::yield();
  Collector next;
  absl::StatusOr<uint64_t> next_id;
  std::atomic<bool> returned{false};
  std::thread submit([&] {
    next_id = engine_->Submit(Req("s", RequestMode::kAppend, Prompt(3, 7), 3), &next);
    returned = true;
  });
  // Well past the 100 ms grace: without the wait it has answered ABORTED by now.
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_FALSE(returned) << next_id.status();
  runner_->LimitSteps(-1);
  submit.join();
  ASSERT_TRUE(next_id.ok()) << next_id.status();
  late.Wait();
  EXPECT_EQ(late.status.code(), absl::StatusCode::kDeadlineExceeded);
  next.Wait();
  EXPECT_TRUE(next.status.ok()) << next.status;
}

// An APPEND chat turn after a reply that stopped without an end-of-generation
// token (here every reply: max_tokens cuts it) closes that reply with the
// template's end-of-turn tokens first, as a FULL_CONTEXT request of the same
// messages renders it; tokens_read = 0 goes back to before the cut reply's
// request and closes the reply before it again. Input without close_turn (raw
// tokens or text) is appended as it is.
TEST_F(EngineTest, AnAppendChatTurnClosesAReplyCutShort) {
  const std::vector<int32_t> close = {Prompt(2, 5)[0], Prompt(2, 5)[1]};  // stands in for <|im_end|>
  Collector first;
  ASSERT_TRUE(engine_->Submit(Req("s", RequestMode::kFullContext, Prompt(20), 4), &first).ok());
  first.Wait();
  ASSERT_EQ(first.result.finish, FinishReason::kLength);
  GenerateRequest turn = Req("s", RequestMode::kAppend, Prompt(3, 7), 3);
  turn.close_turn = close;
  Collector second;
  ASSERT_TRUE(engine_->Submit(turn, &second).ok());
  second.Wait();
  ASSERT_TRUE(second.status.ok()) << second.status;
  std::vector<int32_t> seen = Prompt(20);
  seen.insert(seen.end(), first.tokens.begin(), first.tokens.end());
  seen.insert(seen.end(), close.begin(), close.end());
  for (int32_t t : Prompt(3, 7)) seen.push_back(t);
  EXPECT_EQ(second.result.prompt_tokens, static_cast<int64_t>(seen.size()));
  EXPECT_EQ(second.tokens, Expected(seen, 3));
  EXPECT_EQ(engine_->View("s", "t")->last_request_tokens, 2 + 3 + 3);

  // The client read none of the second reply: back to before its request, whose
  // resent turn closes the first reply again.
  turn.tokens_read = 0;
  Collector again;
  ASSERT_TRUE(engine_->Submit(turn, &again).ok());
  again.Wait();
  ASSERT_TRUE(again.status.ok()) << again.status;
  EXPECT_EQ(again.result.prompt_tokens, static_cast<int64_t>(seen.size()));
  EXPECT_EQ(again.tokens, Expected(seen, 3));

  // Raw input continues the reply as it stands.
  Collector raw;
  ASSERT_TRUE(engine_->Submit(Req("s", RequestMode::kAppend, Prompt(2, 9), 2), &raw).ok());
  raw.Wait();
  ASSERT_TRUE(raw.status.ok()) << raw.status;
  seen.insert(seen.end(), again.tokens.begin(), again.tokens.end());
  for (int32_t t : Prompt(2, 9)) seen.push_back(t);
  EXPECT_EQ(raw.tokens, Expected(seen, 2));
}

// A reply that ended its turn, cut short by the next request's tokens_read, is
// open: that request closes it first, and a tokens_read = 0 after it, which
// goes back to before that request, closes it again. Before, the worker
// remembered the whole reply's state (closed) for tokens_read = 0, and the
// next message followed the cut reply without its end of turn, answered OK
// (qa22's s207 divergence, isolated by qa24).
TEST_F(EngineTest, ATokensReadZeroAfterCuttingAFinishedReplyClosesItAgain) {
  const std::vector<int32_t> close = {Prompt(2, 5)[0], Prompt(2, 5)[1]};  // stands in for <|im_end|>
  const std::vector<int32_t> reply = Prompt(4, 11);
  // A reply of 5 tokens that ended with end of generation, as a stream
  // continued from another worker carries it.
  GenerateRequest ended = Req("s", RequestMode::kFullContext, Prompt(20), 8);
  ended.input.insert(ended.input.end(), reply.begin(), reply.end());
  ended.input.push_back(tokenizer_->eos_id());
  ended.continued = 5;
  Collector first;
  ASSERT_TRUE(engine_->Submit(ended, &first).ok());
  first.Wait();
  ASSERT_TRUE(first.status.ok()) << first.status;
  ASSERT_EQ(first.result.finish, FinishReason::kStop);
  ASSERT_TRUE(first.tokens.empty());

  // The client read 2 tokens of it: the reply is cut there and closed.
  std::vector<int32_t> seen = Prompt(20);
  seen.insert(seen.end(), reply.begin(), reply.begin() + 2);
  seen.insert(seen.end(), close.begin(), close.end());
  GenerateRequest cut = Req("s", RequestMode::kAppend, Prompt(3, 7), 3);
  cut.close_turn = close;
  cut.tokens_read = 2;
  Collector second;
  ASSERT_TRUE(engine_->Submit(cut, &second).ok());
  second.Wait();
  ASSERT_TRUE(second.status.ok()) << second.status;
  std::vector<int32_t> want = seen;
  for (int32_t t : Prompt(3, 7)) want.push_back(t);
  EXPECT_EQ(second.result.prompt_tokens, static_cast<int64_t>(want.size()));
  EXPECT_EQ(second.tokens, Expected(want, 3));

  // It read none of that request's reply: back to the cut reply, closed again.
  GenerateRequest redo = Req("s", RequestMode::kAppend, Prompt(3, 9), 3);
  redo.close_turn = close;
  redo.tokens_read = 0;
  Collector third;
  ASSERT_TRUE(engine_->Submit(redo, &third).ok());
  third.Wait();
  ASSERT_TRUE(third.status.ok()) << third.status;
  want = seen;
  for (int32_t t : Prompt(3, 9)) want.push_back(t);
  EXPECT_EQ(third.result.prompt_tokens, static_cast<int64_t>(want.size()));
  EXPECT_EQ(third.tokens, Expected(want, 3));
}

// "Stop generating" on a request that asked to pin its session: the session
// keeps the tokens sent, and is pinned as a completed request's would be. It
// used to be left unpinned.
TEST_F(EngineTest, APinningRequestCancelledAfterTokensStillPinsItsSession) {
  const int s0 = runner_->steps();
  runner_->LimitSteps(s0 + 2);
  GenerateRequest req = Req("s", RequestMode::kFullContext, Prompt(20), 50);
  req.pin = true;
  Collector c;
  auto id = engine_->Submit(req, &c);
  ASSERT_TRUE(id.ok()) << id.status();
  runner_->WaitForEntered(s0 + 3);
  engine_->Cancel(*id);
  runner_->LimitSteps(-1);
  c.Wait();
  EXPECT_EQ(c.status.code(), absl::StatusCode::kCancelled);
  ASSERT_GE(c.tokens.size(), 1u);
  auto info = kv_->GetSession(kv::SessionKey("t", "s"));
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_TRUE(info->user_pinned);
}

// Submits labelled requests and notes the order in which they sample their first
// token (observers run on the engine thread).
class FirstTokenOrder {
 public:
  absl::Status Submit(Engine& engine, const std::string& label, GenerateRequest request) {
    requests_.push_back(std::make_unique<Request>(this, label));
    return engine.Submit(std::move(request), requests_.back().get()).status();
  }

  // Waits for every request submitted; each must have succeeded.
  void WaitAllOk() {
    for (auto& r : requests_) {
      r->Wait();
      EXPECT_TRUE(r->status.ok()) << r->label() << ": " << r->status;
    }
  }

  std::vector<std::string> labels() {
    absl::MutexLock lock(&mu_);
    return labels_;
  }

 private:
  class Request : public Collector {
   public:
    Request(FirstTokenOrder* order, std::string label) : order_(order), label_(std::move(label)) {}
    void OnToken(int32_t id, absl::string_view text) override {
      if (tokens.empty()) order_->Add(label_);
      Collector::OnToken(id, text);
    }
    const std::string& label() const { return label_; }

   private:
    FirstTokenOrder* const order_;
    const std::string label_;
  };

  void Add(const std::string& label) {
    absl::MutexLock lock(&mu_);
    labels_.push_back(label);
  }

  std::vector<std::unique_ptr<Request>> requests_;
  absl::Mutex mu_;
  std::vector<std::string> labels_ ABSL_GUARDED_BY(mu_);
};

// One tenant's backlog does not queue another tenant's requests behind it: a
// free slot goes to the tenant with the fewest running, then to the one admitted
// least recently; a tenant's own requests keep their order. (Arrival order
// would run a1 a2 a3 b1 b2 c1.)
TEST_F(EngineTest, QueuedRequestsAreAdmittedFairlyAcrossTenants) {
  EngineOptions o;
  o.max_running = 1;
  Build(/*tier0_pages=*/64, /*tier1_pages=*/64, o);
  FirstTokenOrder order;
  const int s0 = runner_->steps();
  runner_->LimitSteps(s0 + 1);
  ASSERT_TRUE(order.Submit(*engine_, "a1", Req("", RequestMode::kFullContext, Prompt(5), 3, "a")).ok());
  runner_->WaitForEntered(s0 + 2);  // a1 runs; the others queue behind it
  const std::vector<std::pair<std::string, std::string>> queued = {
      {"a2", "a"}, {"a3", "a"}, {"b1", "b"}, {"b2", "b"}, {"c1", "c"}};
  for (size_t i = 0; i < queued.size(); ++i) {
    const auto& [label, tenant] = queued[i];
    ASSERT_TRUE(order
                    .Submit(*engine_, label,
                            Req("", RequestMode::kFullContext, Prompt(5, static_cast<int>(i) + 1), 3, tenant))
                    .ok());
  }
  runner_->LimitSteps(-1);
  order.WaitAllOk();
  EXPECT_THAT(order.labels(), ::testing::ElementsAre("a1", "b1", "c1", "a2", "b2", "a3"));
}

// Prompts are computed fairly across tenants: the tenant that got fewer prompt
// tokens computed since it started waiting goes first, so one tenant's many short
// prompts do not hold back another tenant's longer one. (Shortest first alone
// would compute all four of a's before b's.)
TEST_F(EngineTest, PromptsAreComputedFairlyAcrossTenants) {
  BuildWithTwoPagesOfPromptPerStep();
  Collector held;
  auto held_id = SubmitHeldInItsThirdStep("held", &held);
  ASSERT_TRUE(held_id.ok()) << held_id.status();
  FirstTokenOrder order;
  for (int i = 0; i < 5; ++i) {
    const bool b = i == 4;
    ASSERT_TRUE(order
                    .Submit(*engine_, b ? "b1" : absl::StrCat("a", i + 1),
                            Req("", RequestMode::kFullContext, Prompt(b ? 48 : 32, i + 1), 2, b ? "b" : "a"))
                    .ok());
  }
  runner_->LimitSteps(-1);
  order.WaitAllOk();
  EXPECT_THAT(order.labels(), ::testing::ElementsAre("a1", "b1", "a2", "a3", "a4"));
  engine_->Cancel(*held_id);
  held.Wait();
}

// A prompt ages by its own tenant's prompt work, not every tenant's: a tenant's
// short next prompt still goes before its own older long one while another
// tenant's prompts are computed in between (aged by all work, the long one,
// older, would tie with it and go first).
TEST_F(EngineTest, PromptsAgeByTheirOwnTenantsWork) {
  BuildWithTwoPagesOfPromptPerStep();
  Collector held;
  const int s0 = runner_->steps();
  auto held_id = SubmitHeldInItsThirdStep("held", &held);  // inside step s0 + 3
  ASSERT_TRUE(held_id.ok()) << held_id.status();
  FirstTokenOrder order;
  for (int i = 0; i < 4; ++i) {
    const bool b = i == 3;
    ASSERT_TRUE(order
                    .Submit(*engine_, b ? "b1" : absl::StrCat("a", i + 1),
                            Req("", RequestMode::kFullContext, Prompt(b ? 96 : 32, i + 1), 2, b ? "b" : "a"))
                    .ok());
  }
  // Steps s0 + 4, 5, 6 compute a1, b1's first 32 tokens and a2 (the least served
  // tenant first); b2 arrives during s0 + 6, when b1 has 64 tokens left.
  runner_->LimitSteps(s0 + 5);
  runner_->WaitForEntered(s0 + 6);
  ASSERT_TRUE(order.Submit(*engine_, "b2", Req("", RequestMode::kFullContext, Prompt(16, 5), 2, "b")).ok());
  runner_->LimitSteps(-1);
  order.WaitAllOk();
  const std::vector<std::string> labels = order.labels();
  auto at = [&labels](const std::string& label) {
    return std::find(labels.begin(), labels.end(), label) - labels.begin();
  };
  EXPECT_LT(at("b2"), at("b1")) << ::testing::PrintToString(labels);
  engine_->Cancel(*held_id);
  held.Wait();
}

// A prompt being computed ages by the others' work only, not by its own
// progress: a short next turn arriving midway goes before the rest of a long
// prompt when that rest is longer (shortest remaining first). Counting its own
// 160 computed tokens as waiting, the long prompt would go first.
TEST_F(EngineTest, APromptsOwnProgressIsNotWaiting) {
  BuildWithTwoPagesOfPromptPerStep();
  Collector held;
  const int s0 = runner_->steps();
  auto held_id = SubmitHeldInItsThirdStep("held", &held);  // inside step s0 + 3
  ASSERT_TRUE(held_id.ok()) << held_id.status();
  FirstTokenOrder order;
  ASSERT_TRUE(
      order.Submit(*engine_, "long", Req("", RequestMode::kFullContext, Prompt(256, 1), 2, "a")).ok());
  // Steps s0 + 4 ... 8 compute 32 tokens of it each; "short" arrives during
  // s0 + 8, when 96 are left.
  runner_->LimitSteps(s0 + 7);
  runner_->WaitForEntered(s0 + 8);
  ASSERT_TRUE(
      order.Submit(*engine_, "short", Req("", RequestMode::kFullContext, Prompt(48, 2), 2, "a")).ok());
  runner_->LimitSteps(-1);
  order.WaitAllOk();
  EXPECT_THAT(order.labels(), ::testing::ElementsAre("short", "long"));
  engine_->Cancel(*held_id);
  held.Wait();
}

// A full queue does not lock other tenants out: a request of a tenant holding
// at least two fewer queued requests than the fullest one pushes out that
// tenant's newest (RESOURCE_EXHAUSTED, before any token, its quota given back);
// otherwise it is refused as before.
TEST_F(EngineTest, FullQueuePushesOutTheFullestTenantsNewestRequest) {
  EngineOptions o;
  o.max_running = 1;
  o.max_waiting = 3;
  Build(/*tier0_pages=*/64, /*tier1_pages=*/64, o);
  Collector held;
  auto held_id = SubmitHeldInItsThirdStep("held", &held);  // tenant "t"
  ASSERT_TRUE(held_id.ok()) << held_id.status();
  Collector a[4], b[2];
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(engine_->Submit(Req("", RequestMode::kFullContext, Prompt(5, i), 2, "a"), &a[i]).ok());
  }
  auto refused = engine_->Submit(Req("", RequestMode::kFullContext, Prompt(5, 3), 2, "a"), &a[3]);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_THAT(refused.status().message(), ::testing::HasSubstr("queue full"));
  // b holds none: a's newest (a[2]) makes room.
  ASSERT_TRUE(engine_->Submit(Req("", RequestMode::kFullContext, Prompt(5, 4), 2, "b"), &b[0]).ok());
  // a holds 2, b 1: neither may push the other out now.
  EXPECT_EQ(engine_->Submit(Req("", RequestMode::kFullContext, Prompt(5, 5), 2, "b"), &b[1]).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(engine_->Submit(Req("", RequestMode::kFullContext, Prompt(5, 6), 2, "a"), &a[3]).status().code(),
            absl::StatusCode::kResourceExhausted);
  engine_->Cancel(*held_id);
  runner_->LimitSteps(-1);  // the pushed-out request leaves at the engine thread's next turn
  a[2].Wait();
  EXPECT_EQ(a[2].status.code(), absl::StatusCode::kResourceExhausted) << a[2].status;
  EXPECT_THAT(std::string(a[2].status.message()), ::testing::HasSubstr("tenant 'a' held the most"));
  EXPECT_TRUE(a[2].tokens.empty());
  held.Wait();
  for (int i = 0; i < 2; ++i) {
    a[i].Wait();
    EXPECT_TRUE(a[i].status.ok()) << a[i].status;
  }
  b[0].Wait();
  EXPECT_TRUE(b[0].status.ok()) << b[0].status;
  ASSERT_TRUE(engine_->WaitIdle(absl::Seconds(10)));
  EXPECT_EQ(engine_->tracked_request_ids(), 0u);
}

TEST_F(EngineTest, QueuedRequestsHonourCancelAndDeadlineAtOnce) {
  EngineOptions o;
  o.max_running = 1;
  o.tenant_limits.max_requests = 3;
  Build(/*tier0_pages=*/64, /*tier1_pages=*/64, o);
  runner_->LimitSteps(1);
  Collector running, cancelled, late, after;
  ASSERT_TRUE(engine_->Submit(Req("a", RequestMode::kFullContext, Prompt(5), 50), &running).ok());
  auto queued = engine_->Submit(Req("b", RequestMode::kFullContext, Prompt(6), 5), &cancelled);
  ASSERT_TRUE(queued.ok());
  GenerateRequest soon = Req("c", RequestMode::kFullContext, Prompt(7), 5);
  soon.deadline = absl::Now();  // passes while it waits behind the first request
  ASSERT_TRUE(engine_->Submit(soon, &late).ok());
  engine_->Cancel(*queued);
  runner_->AllowSteps(1);  // one step boundary, while "a" still has 48 tokens to go
  cancelled.Wait();
  late.Wait();
  EXPECT_EQ(cancelled.status.code(), absl::StatusCode::kCancelled) << cancelled.status;
  EXPECT_EQ(late.status.code(), absl::StatusCode::kDeadlineExceeded) << late.status;
  EXPECT_FALSE(running.done.HasBeenNotified());
  EXPECT_TRUE(cancelled.tokens.empty());
  // Their tenant quota and session ids are free again.
  ASSERT_TRUE(engine_->Submit(Req("b", RequestMode::kFullContext, Prompt(6), 2), &after).ok());
  runner_->LimitSteps(-1);
  running.Wait();
  after.Wait();
  EXPECT_TRUE(running.status.ok());
  EXPECT_TRUE(after.status.ok());
  ASSERT_TRUE(engine_->WaitIdle(absl::Seconds(10)));
  EXPECT_EQ(engine_->tracked_request_ids(), 0u);
}

TEST_F(EngineTest, CancellingFinishedRequestsLeaksNothing) {
  for (int i = 0; i < 200; ++i) {
    Collector c;
    auto id = engine_->Submit(Req("", RequestMode::kFullContext, Prompt(3, i), 1), &c);
    ASSERT_TRUE(id.ok());
    c.Wait();
    engine_->Cancel(*id);  // too late: a no-op that must not be remembered
    engine_->Cancel(*id + 1000000);
  }
  ASSERT_TRUE(engine_->WaitIdle(absl::Seconds(10)));
  EXPECT_EQ(engine_->tracked_request_ids(), 0u);
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

TEST_F(EngineTest, BurstSharingAPrefixComputesItOnce) {
  // Eight new conversations with one 96-token system prompt arrive together; the
  // first computes the prompt (in two steps: the fake runner takes 64 tokens a
  // step), the others wait for its pages and join them.
  Build(/*tier0_pages=*/64, /*tier1_pages=*/0);
  int64_t prefill_tokens = 0, joined_tokens = 0;
  engine_->SetStepCallback([&](const StepStats& s) {
    prefill_tokens += s.prefill_tokens;
    joined_tokens += s.joined_tokens;
  });
  constexpr int kUsers = 8, kShared = 96, kPrivate = 5, kAnswer = 4;
  runner_->LimitSteps(0);  // everything is queued before the first step runs
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::unique_ptr<Collector>> out;
  for (int i = 0; i < kUsers; ++i) {
    std::vector<int32_t> p = Prompt(kShared);
    for (int32_t t : Prompt(kPrivate, 30 + i)) p.push_back(t);
    prompts.push_back(p);
    out.push_back(std::make_unique<Collector>());
    ASSERT_TRUE(
        engine_->Submit(Req("u" + std::to_string(i), RequestMode::kFullContext, p, kAnswer), out.back().get())
            .ok());
  }
  runner_->LimitSteps(-1);
  int64_t cached = 0;
  for (int i = 0; i < kUsers; ++i) {
    const GenerateResult& r = out[i]->Wait();
    ASSERT_TRUE(out[i]->status.ok()) << out[i]->status;
    EXPECT_EQ(out[i]->tokens, Expected(prompts[i], kAnswer)) << "user " << i;
    cached += r.cached_tokens;
  }
  ASSERT_TRUE(engine_->WaitIdle(absl::Seconds(10)));
  const int64_t ideal = kShared + kUsers * kPrivate;
  EXPECT_EQ(prefill_tokens, ideal) << "joined " << joined_tokens;
  EXPECT_GT(joined_tokens, 0);
  EXPECT_GE(cached, (kUsers - 1) * kShared);
  EXPECT_EQ(prefill_tokens + cached, kUsers * (kShared + kPrivate))
      << "every prompt token is either computed or served from cache";
}

TEST_F(EngineTest, LongPromptIsNotStarvedByShorterOnes) {
  // Every step has room for one 32-token prompt, and a new short prompt arrives
  // whenever one finishes. Shortest-first alone would run the 320-token prompt
  // only after the last short one; aged by the prompt work done since it
  // arrived, it goes first once the engine has computed about twice its length.
  EngineOptions options;
  options.max_batch_tokens = 32;
  options.max_step_time = absl::Milliseconds(-1);  // the token budget alone sizes chunks
  Build(/*tier0_pages=*/64, /*tier1_pages=*/0, options);
  constexpr int kLong = 320, kShort = 32, kShorts = 60;

  class Counting : public Collector {
   public:
    explicit Counting(std::atomic<int>* finished) : finished_(finished) {}
    void OnDone(const absl::Status& s, const GenerateResult& r) override {
      finished_->fetch_add(1);
      Collector::OnDone(s, r);
    }

   private:
    std::atomic<int>* finished_;
  };
  std::atomic<int> shorts_finished{0};
  std::atomic<int> shorts_before_long{-1};
  class Long : public Collector {
   public:
    Long(std::atomic<int>* finished, std::atomic<int>* before) : finished_(finished), before_(before) {}
    void OnToken(int32_t id, absl::string_view text) override {
      if (tokens.empty()) before_->store(finished_->load());
      Collector::OnToken(id, text);
    }

   private:
    std::atomic<int>* finished_;
    std::atomic<int>* before_;
  };
  Long long_out(&shorts_finished, &shorts_before_long);
  std::vector<std::unique_ptr<Counting>> shorts;
  for (int i = 0; i < kShorts; ++i) shorts.push_back(std::make_unique<Counting>(&shorts_finished));
  int submitted = 0;  // engine thread (step callback) once steps run
  auto submit_short = [&] {
    const int i = submitted++;
    ASSERT_TRUE(
        engine_->Submit(Req("", RequestMode::kFullContext, Prompt(kShort, 100 + i), 1), shorts[i].get())
            .ok());
  };
  runner_->LimitSteps(0);
  ASSERT_TRUE(engine_->Submit(Req("", RequestMode::kFullContext, Prompt(kLong, 7), 1), &long_out).ok());
  submit_short();
  submit_short();
  // Two short prompts are always queued: the next arrives before the next step.
  engine_->SetStepCallback([&](const StepStats&) {
    while (submitted < kShorts && submitted - shorts_finished.load() < 2) submit_short();
  });
  runner_->LimitSteps(-1);
  long_out.Wait();
  ASSERT_TRUE(long_out.status.ok()) << long_out.status;
  EXPECT_EQ(long_out.tokens, Expected(Prompt(kLong, 7), 1));
  for (auto& c : shorts) c->Wait();
  engine_->SetStepCallback(nullptr);
  for (int i = 0; i < kShorts; ++i) {
    ASSERT_TRUE(shorts[i]->status.ok()) << shorts[i]->status;
    EXPECT_EQ(shorts[i]->tokens, Expected(Prompt(kShort, 100 + i), 1)) << "short " << i;
  }
  // Short prompts still go first while the long one is fresh (first come, first
  // served would answer it before any), and it goes first after about
  // 2 * kLong / kShort of them (shortest-first alone: after all kShorts).
  EXPECT_GE(shorts_before_long.load(), kLong / kShort);
  EXPECT_LE(shorts_before_long.load(), 2 * kLong / kShort + 4);
}

TEST_F(EngineTest, APromptGoesOnToItsPageEndWhenTheStepTargetLeavesLessThanAPage) {
  // A step-time target that no prefill fits: beside a decoding stream each step
  // moves one prompt on by a token. That prompt keeps the token until its chunk
  // reaches a page end (here its own end), so the prompts of four tenants finish
  // one after another. Round robin a token at a time, all four finished within
  // the last four of those 40 steps.
  EngineOptions options;
  options.max_step_time = absl::Nanoseconds(1);
  Build(/*tier0_pages=*/64, /*tier1_pages=*/0, options);
  // The step cost model needs four steps with prompts and four with decodes.
  for (int i = 0; i < 4; ++i) {
    Collector warm;
    ASSERT_TRUE(engine_->Submit(Req("", RequestMode::kFullContext, Prompt(20, 50 + i), 4), &warm).ok());
    warm.Wait();
    ASSERT_TRUE(warm.status.ok()) << warm.status;
  }

  class FirstTokenStep : public Collector {
   public:
    explicit FirstTokenStep(FakeRunner* runner) : runner_(runner) {}
    void OnToken(int32_t id, absl::string_view text) override {
      if (tokens.empty()) first_step = runner_->steps();
      Collector::OnToken(id, text);
    }
    int first_step = -1;

   private:
    FakeRunner* runner_;
  };
  Collector stream;
  ASSERT_TRUE(SubmitHeldInItsThirdStep("stream", &stream).ok());  // 50 tokens, held in a step
  const int held = runner_->steps() + 1;                          // the step it is held in
  int max_prefill_beside_decode = 0;                              // engine thread; read after Wait
  engine_->SetStepCallback([&](const StepStats& s) {
    if (s.decode_tokens > 0)
      max_prefill_beside_decode = std::max(max_prefill_beside_decode, s.prefill_tokens);
  });
  constexpr int kPrompts = 4, kPromptTokens = 10;  // 40 steps of one token, while the stream decodes
  std::vector<std::unique_ptr<FirstTokenStep>> outs;
  for (int i = 0; i < kPrompts; ++i) {
    outs.push_back(std::make_unique<FirstTokenStep>(runner_.get()));
    ASSERT_TRUE(engine_
                    ->Submit(Req("", RequestMode::kFullContext, Prompt(kPromptTokens, 10 + i), 1,
                                 absl::StrCat("tenant", i)),
                             outs.back().get())
                    .ok());
  }
  runner_->LimitSteps(-1);
  for (int i = 0; i < kPrompts; ++i) {
    outs[i]->Wait();
    ASSERT_TRUE(outs[i]->status.ok()) << outs[i]->status;
    EXPECT_EQ(outs[i]->tokens, Expected(Prompt(kPromptTokens, 10 + i), 1));
    // Prompt i's last token goes in the (i + 1) * kPromptTokens-th step after the held one.
    EXPECT_EQ(outs[i]->first_step, held + (i + 1) * kPromptTokens) << "prompt " << i;
  }
  stream.Wait();
  engine_->SetStepCallback(nullptr);
  ASSERT_TRUE(stream.status.ok()) << stream.status;
  EXPECT_EQ(stream.tokens, Expected(Prompt(20), 50));
  EXPECT_EQ(max_prefill_beside_decode, 1);  // the target held: the floor of one token only
}

TEST_F(EngineTest, RequestFailingBeforeItsFirstTokenLeavesTheSessionAsItWas) {
  // A FULL_CONTEXT turn with another history, and an APPEND, each cancelled
  // after a prompt chunk has gone into the session's cache but before a token:
  // the session keeps its conversation, its cache holds a prefix of it, and the
  // next APPEND continues it as if neither had happened.
  EngineOptions options;
  options.max_batch_tokens = 32;
  options.max_step_time = absl::Milliseconds(-1);
  Build(/*tier0_pages=*/64, /*tier1_pages=*/64, options);
  Collector first;
  ASSERT_TRUE(engine_->Submit(Req("s", RequestMode::kFullContext, Prompt(40), 3), &first).ok());
  first.Wait();
  ASSERT_TRUE(first.status.ok()) << first.status;
  std::vector<int32_t> conversation = Prompt(40);
  conversation.insert(conversation.end(), first.tokens.begin(), first.tokens.end());
  ASSERT_EQ(*engine_->Context("s", "t"), conversation);

  for (RequestMode mode : {RequestMode::kFullContext, RequestMode::kAppend}) {
    SCOPED_TRACE(mode == RequestMode::kFullContext ? "FULL_CONTEXT" : "APPEND");
    const int steps = runner_->steps();
    runner_->LimitSteps(steps + 1);  // one prompt chunk of the 100 tokens, then hold
    Collector failed;
    auto id = engine_->Submit(Req("s", mode, Prompt(100, 3), 3), &failed);
    ASSERT_TRUE(id.ok()) << id.status();
    runner_->WaitForSteps(steps + 1);
    engine_->Cancel(*id);
    runner_->LimitSteps(-1);
    failed.Wait();
    EXPECT_EQ(failed.status.code(), absl::StatusCode::kCancelled);
    EXPECT_TRUE(failed.tokens.empty());
    EXPECT_EQ(*engine_->Context("s", "t"), conversation);
    auto held = kv_->GetTokens(kv::SessionKey("t", "s"));
    ASSERT_TRUE(held.ok()) << held.status();
    ASSERT_LE(held->size(), conversation.size());
    EXPECT_TRUE(std::equal(held->begin(), held->end(), conversation.begin()));
  }
  Collector next;
  ASSERT_TRUE(engine_->Submit(Req("s", RequestMode::kAppend, Prompt(5, 9), 4), &next).ok());
  next.Wait();
  ASSERT_TRUE(next.status.ok()) << next.status;
  std::vector<int32_t> expected_context = conversation;
  for (int32_t t : Prompt(5, 9)) expected_context.push_back(t);
  EXPECT_EQ(next.tokens, Expected(expected_context, 4));
}

TEST_F(EngineTest, NewSessionRestoresAPrefixFoundInTier1) {
  Build(/*tier0_pages=*/16, /*tier1_pages=*/64);
  const std::vector<int32_t> system = Prompt(160);
  Collector a;
  std::vector<int32_t> pa = system;
  pa.push_back(kFirstByteToken + 'z');
  ASSERT_TRUE(engine_->Submit(Req("a", RequestMode::kFullContext, pa, 3), &a).ok());
  a.Wait();
  ASSERT_TRUE(engine_->Offload("a", "t").ok());
  // A large unrelated session evicts the tier-0 copies of a's prefix pages.
  Collector f;
  ASSERT_TRUE(engine_->Submit(Req("f", RequestMode::kFullContext, Prompt(200, 17), 2), &f).ok());
  f.Wait();
  ASSERT_TRUE(f.status.ok()) << f.status;
  ASSERT_EQ(kv_->LookupPrefix("t", system), 160);  // found, in tier 1 only
  Collector b;
  std::vector<int32_t> pb = system;
  for (int32_t t : Prompt(9, 4)) pb.push_back(t);
  ASSERT_TRUE(engine_->Submit(Req("b", RequestMode::kFullContext, pb, 5), &b).ok());
  const GenerateResult& r = b.Wait();
  ASSERT_TRUE(b.status.ok()) << b.status;
  EXPECT_EQ(b.tokens, Expected(pb, 5));
  EXPECT_EQ(r.cached_tokens, 160);
  EXPECT_EQ(r.restored_tokens, 160);
  EXPECT_EQ(r.recomputed_tokens, 0);
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
  // A fork is a new session too: refused at the limit, and it leaves nothing.
  const absl::Status fork = engine_->ForkSession("s1", "s1-fork", "t1");
  EXPECT_EQ(fork.code(), absl::StatusCode::kResourceExhausted) << fork;
  EXPECT_NE(fork.message().find("its limit is 2"), absl::string_view::npos) << fork;
  EXPECT_EQ(engine_->Context("s1-fork", "t1").status().code(), absl::StatusCode::kNotFound);
  // Another tenant's quota is its own; closing a session makes room for a fork.
  ASSERT_TRUE(engine_->CloseSession("s2", "t1").ok());
  ASSERT_TRUE(engine_->ForkSession("s1", "s2", "t1").ok());
  EXPECT_EQ(engine_->ForkSession("s1", "s3", "t1").code(), absl::StatusCode::kResourceExhausted);
  {
    Collector z;
    ASSERT_TRUE(engine_->Submit(Req("u1", RequestMode::kFullContext, Prompt(20), 2, "t2"), &z).ok());
    z.Wait();
    ASSERT_TRUE(z.status.ok()) << z.status;
    EXPECT_TRUE(engine_->ForkSession("u1", "u2", "t2").ok());
  }
  // Pinned pages: s1 holds 2 pages (21 tokens), pinning s2 too would make 4 > 3.
  ASSERT_TRUE(engine_->SetPinned("s1", "t1", true).ok());
  EXPECT_EQ(engine_->SetPinned("s2", "t1", true).code(), absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(engine_->SetPinned("s1", "t1", false).ok());
  EXPECT_TRUE(engine_->SetPinned("s2", "t1", true).ok());
  // A request on the pinned session counts the session once, as large as it may
  // grow: a short turn (2 pages after it) fits, pin or no pin...
  for (bool pin : {true, false}) {
    GenerateRequest turn = Req("s2", RequestMode::kAppend, Prompt(1), 1, "t1");
    turn.pin = pin;
    Collector x;
    ASSERT_TRUE(engine_->Submit(turn, &x).ok()) << "pin=" << pin;
    x.Wait();
    ASSERT_TRUE(x.status.ok()) << x.status;
  }
  // ...and a turn that could take it to 4 pages does not, even without `pin`
  // (the session stays pinned either way).
  Collector big;
  const auto refused = engine_->Submit(Req("s2", RequestMode::kAppend, Prompt(30), 2, "t1"), &big);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_NE(refused.status().message().find("would pin 4 pages"), absl::string_view::npos)
      << refused.status();
}

TEST_F(EngineTest, TenantsAreSeparateNamespaces) {
  // The same id in two tenants: two sessions with their own contexts.
  Collector a, b;
  const auto pa = Prompt(20, 1), pb = Prompt(24, 2);
  ASSERT_TRUE(engine_->Submit(Req("same", RequestMode::kFullContext, pa, 3, "t1"), &a).ok());
  ASSERT_TRUE(engine_->Submit(Req("same", RequestMode::kFullContext, pb, 3, "t2"), &b).ok());
  a.Wait();
  b.Wait();
  ASSERT_TRUE(a.status.ok()) << a.status;
  ASSERT_TRUE(b.status.ok()) << b.status;
  EXPECT_EQ(a.result.session_id, "same");
  Collector a2, b2;
  ASSERT_TRUE(engine_->Submit(Req("same", RequestMode::kAppend, Prompt(3, 9), 4, "t1"), &a2).ok());
  ASSERT_TRUE(engine_->Submit(Req("same", RequestMode::kAppend, Prompt(3, 9), 4, "t2"), &b2).ok());
  a2.Wait();
  b2.Wait();
  auto full = [](std::vector<int32_t> p, const std::vector<int32_t>& out, const std::vector<int32_t>& more) {
    p.insert(p.end(), out.begin(), out.end());
    p.insert(p.end(), more.begin(), more.end());
    return p;
  };
  EXPECT_EQ(a2.tokens, Expected(full(pa, a.tokens, Prompt(3, 9)), 4));
  EXPECT_EQ(b2.tokens, Expected(full(pb, b.tokens, Prompt(3, 9)), 4));
  // Closing one leaves the other; another tenant's id answers exactly like an
  // unknown one.
  ASSERT_TRUE(engine_->CloseSession("same", "t1").ok());
  EXPECT_TRUE(engine_->Context("same", "t2").ok());
  const absl::Status theirs = engine_->CloseSession("same", "t1");
  const absl::Status unknown = engine_->CloseSession("nobody", "t1");
  EXPECT_EQ(theirs.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(engine_->Reserve("same", "t3").code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(std::string(theirs.message()), absl::StrReplaceAll(unknown.message(), {{"nobody", "same"}}));
  // Forks and quotas stay inside the tenant too.
  EXPECT_TRUE(engine_->ForkSession("same", "copy", "t2").ok());
  EXPECT_EQ(engine_->ForkSession("same", "copy", "t1").code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(engine_->Sessions().size(), 2u);
  EXPECT_TRUE(kv_->CheckInvariants().ok());
}

TEST_F(EngineTest, IdleSessionsExpireExceptPinnedOnes) {
  EngineOptions o;
  o.session_idle_ttl = absl::Hours(1);  // the engine's own sweep stays out of the way
  Build(/*tier0_pages=*/64, /*tier1_pages=*/64, o);
  for (const char* id : {"idle", "pinned"}) {
    Collector c;
    ASSERT_TRUE(engine_->Submit(Req(id, RequestMode::kFullContext, Prompt(20), 2), &c).ok());
    c.Wait();
  }
  ASSERT_TRUE(engine_->SetPinned("pinned", "t", true).ok());
  const absl::Time pinned_last_used = engine_->View("pinned", "t")->last_used;
  EXPECT_EQ(engine_->ExpireIdleSessions(absl::Now() + absl::Minutes(30)), 0);  // not idle long enough
  const uint64_t seq = kv_->ReadEvents(0, 0).last_seq;
  EXPECT_EQ(engine_->ExpireIdleSessions(absl::Now() + absl::Hours(2)), 1);
  EXPECT_EQ(engine_->Context("idle", "t").status().code(), absl::StatusCode::kNotFound);
  EXPECT_FALSE(kv_->GetSession(kv::SessionKey("t", "idle")).ok());
  EXPECT_TRUE(engine_->Context("pinned", "t").ok());
  EXPECT_EQ(engine_->Load().sessions_expired, 1);
  // Routers hear of it as a closed session.
  bool closed = false;
  for (const kv::KvEvent& e : kv_->ReadEvents(seq).events) {
    closed |= e.type == kv::KvEventType::kSessionClosed && e.session_id == kv::SessionKey("t", "idle");
  }
  EXPECT_TRUE(closed);
  // A session in use is never expired under its request.
  ASSERT_TRUE(engine_->Reserve("pinned", "t").ok());
  ASSERT_TRUE(engine_->SetPinned("pinned", "t", false).code() == absl::StatusCode::kAborted);
  EXPECT_EQ(engine_->ExpireIdleSessions(absl::Now() + absl::Hours(5)), 0);
  engine_->Release("pinned", "t");
  // The sweeps left the pinned session's last request time alone (GetSession
  // reports it): unpinned, it is as idle as that request makes it.
  EXPECT_EQ(engine_->View("pinned", "t")->last_used, pinned_last_used);
  ASSERT_TRUE(engine_->SetPinned("pinned", "t", false).ok());
  EXPECT_EQ(engine_->ExpireIdleSessions(absl::Now() + absl::Hours(2)), 1);
}

TEST_F(EngineTest, ExportMarksTheSessionAndHandingOverForgetsIt) {
  Collector c;
  ASSERT_TRUE(engine_->Submit(Req("m", RequestMode::kFullContext, Prompt(40), 3), &c).ok());
  c.Wait();
  EXPECT_FALSE(engine_->View("m", "t")->exporting);
  auto exporter = engine_->BeginExport("m", "t", kv::ExportOptions{});
  ASSERT_TRUE(exporter.ok()) << exporter.status();
  EXPECT_TRUE(engine_->View("m", "t")->exporting);
  EXPECT_EQ(engine_->ExpireIdleSessions(absl::Now() + absl::Hours(100)), 0);  // never while exported
  exporter->reset();
  engine_->EndExport("m", "t", /*handed_to=*/"");
  EXPECT_FALSE(engine_->View("m", "t")->exporting);
  ASSERT_TRUE(engine_->Reserve("m", "t").ok());
  engine_->EndExport("m", "t", /*handed_to=*/"w2");
  engine_->Release("m", "t");
  EXPECT_EQ(engine_->View("m", "t").status().code(), absl::StatusCode::kNotFound);
  EXPECT_FALSE(kv_->GetSession(kv::SessionKey("t", "m")).ok());
}

// A client's next turn can reach the worker while a session call holds its
// session, e.g. a migration's pause (a rebalance the client does not know of):
// the request waits for the call instead of failing ABORTED. It then runs on the
// session as the call left it, or finds it moved away (NOT_FOUND, which a router
// follows to the new worker). A call that holds the session for longer than
// kSessionCallWait still gets ABORTED, naming what holds it. (Seen in a
// black-box soak: 14.6% of sequential APPENDs ABORTED during admin moves.)
TEST_F(EngineTest, RequestDuringASessionCallWaitsForIt) {
  Collector first;
  ASSERT_TRUE(engine_->Submit(Req("m", RequestMode::kFullContext, Prompt(40), 3), &first).ok());
  first.Wait();
  ASSERT_TRUE(first.status.ok());

  // Submit on another thread while the session is held; it must still be
  // waiting 200 ms later (the previous engine answered ABORTED at once).
  auto submit_while_held = [&](Collector* c, absl::StatusOr<uint64_t>* id, absl::Notification* returned) {
    return std::thread([this, c, id, returned] {
      *id = engine_->Submit(Req("m", RequestMode::kAppend, Prompt(5, 1), 3), c);
      returned->Notify();
    });
  };

  // A move that failed: the session stays, and the turn runs after the pause.
  ASSERT_TRUE(engine_->Reserve("m", "t").ok());
  Collector second;
  absl::StatusOr<uint64_t> second_id = absl::UnknownError("not submitted");
  absl::Notification second_returned;
  std::thread client = submit_while_held(&second, &second_id, &second_returned);
  EXPECT_FALSE(second_returned.WaitForNotificationWithTimeout(absl::Milliseconds(200)));
  engine_->Release("m", "t");
  client.join();
  ASSERT_TRUE(second_id.ok()) << second_id.status();
  second.Wait();
  EXPECT_TRUE(second.status.ok()) << second.status;
  EXPECT_EQ(second.tokens.size(), 3u);

  // A move that handed the session over: NOT_FOUND here.
  ASSERT_TRUE(engine_->Reserve("m", "t").ok());
  auto exporter = engine_->BeginExport("m", "t", kv::ExportOptions{});
  ASSERT_TRUE(exporter.ok()) << exporter.status();
  Collector third;
  absl::StatusOr<uint64_t> third_id = absl::UnknownError("not submitted");
  absl::Notification third_returned;
  client = submit_while_held(&third, &third_id, &third_returned);
  EXPECT_FALSE(third_returned.WaitForNotificationWithTimeout(absl::Milliseconds(200)));
  exporter->reset();
  engine_->EndExport("m", "t", /*handed_to=*/"w2");
  engine_->Release("m", "t");
  client.join();
  EXPECT_EQ(third_id.status().code(), absl::StatusCode::kNotFound) << third_id.status();

  // Held past the wait: ABORTED, saying a session call holds it.
  Collector fourth;
  ASSERT_TRUE(engine_->Submit(Req("k", RequestMode::kFullContext, Prompt(20), 2), &fourth).ok());
  fourth.Wait();
  ASSERT_TRUE(engine_->Reserve("k", "t").ok());
  Collector fifth;
  const absl::Time start = absl::Now();
  absl::StatusOr<uint64_t> fifth_id = engine_->Submit(Req("k", RequestMode::kAppend, Prompt(5), 2), &fifth);
  EXPECT_GE(absl::Now() - start, absl::Seconds(2));
  EXPECT_EQ(fifth_id.status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(fifth_id.status().message(), ::testing::HasSubstr("session call"));
  engine_->Release("k", "t");
  EXPECT_EQ(engine_->tracked_request_ids(), 0u);
}

// An imported session's pages are in the cache (and its cache events may reach
// a router) a moment before the engine adopts it: an APPEND arriving then waits
// for the adoption instead of answering NOT_FOUND (seen in a rolling update).
// The APPEND and the adoption race from the same moment, twenty times, so that
// the APPEND comes first in some of them.
TEST_F(EngineTest, AppendDuringAnImportsAdoptionWaitsForIt) {
  for (int round = 0; round < 20; ++round) {
    const std::string id = "m" + std::to_string(round);
    Collector first;
    ASSERT_TRUE(engine_->Submit(Req(id, RequestMode::kFullContext, Prompt(40, round), 3), &first).ok());
    first.Wait();
    const std::vector<int32_t> context = *engine_->Context(id, "t");
    auto importer = StageImport(ExportAway(id));  // it left, and comes back
    ASSERT_NE(importer, nullptr);
    ASSERT_TRUE(kv_->GetSession(kv::SessionKey("t", id)).ok());  // in the cache, not yet adopted
    Collector append;
    absl::StatusOr<uint64_t> submitted;
    absl::Notification go;
    std::thread client([&] {
      go.Notify();
      submitted = engine_->Submit(Req(id, RequestMode::kAppend, Prompt(3, 1), 2), &append);
    });
    go.WaitForNotification();
    ASSERT_TRUE(engine_->FinishImport(*importer, context).ok());
    client.join();
    ASSERT_TRUE(submitted.ok()) << "round " << round << ": " << submitted.status();
    append.Wait();
    ASSERT_TRUE(append.status.ok()) << append.status;
    std::vector<int32_t> whole = context;
    for (int32_t t : Prompt(3, 1)) whole.push_back(t);
    EXPECT_EQ(append.tokens, Expected(whole, 2)) << "round " << round;
  }
}

TEST_F(EngineTest, ForkCopiesContext) {
  Collector a;
  auto p = Prompt(30);
  ASSERT_TRUE(engine_->Submit(Req("a", RequestMode::kFullContext, p, 4), &a).ok());
  a.Wait();
  ASSERT_TRUE(engine_->ForkSession("a", "b", "t").ok());
  EXPECT_EQ(engine_->ForkSession("a", "b", "t").code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(*engine_->Context("b", "t"), *engine_->Context("a", "t"));
  Collector x, y;
  ASSERT_TRUE(engine_->Submit(Req("a", RequestMode::kAppend, Prompt(3, 1), 4), &x).ok());
  x.Wait();
  ASSERT_TRUE(engine_->Submit(Req("b", RequestMode::kAppend, Prompt(3, 1), 4), &y).ok());
  y.Wait();
  EXPECT_EQ(x.tokens, y.tokens);
}

}  // namespace
}  // namespace kvcache::sched
