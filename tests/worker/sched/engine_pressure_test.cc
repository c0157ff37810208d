// Exactness under memory pressure: a conversation workload (FULL_CONTEXT and
// APPEND turns, forks) runs on engines whose tier 0 holds about two contexts and
// whose tier 1 is 0, tiny or roomy, with 8 and 32 sessions at once, greedy and
// seeded sampling. Every reply must equal the one a roomy engine gives for the
// same inputs, every request must end OK, and no page may leak.
//
// The fake model reads every earlier token back through the page table, so a
// request that went on at a position the cache no longer holds gives a different
// token (the bug this guards against: a running session truncated under it).
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/worker/sched/fake_runner.h"

namespace kvcache::sched {
namespace {

std::vector<int32_t> Tokens(int n, int salt) {
  std::vector<int32_t> p;
  for (int i = 0; i < n; ++i) p.push_back(kFirstByteToken + 'A' + (i * 7 + salt * 3 + i * salt) % 26);
  return p;
}

struct Outcome {
  absl::Status status;
  std::vector<int32_t> tokens;
  GenerateResult result;
};

// What one run of the workload returned, per request in submission order.
struct RunLog {
  std::vector<std::string> names;  // "session/turn"
  std::vector<Outcome> outcomes;
  int64_t recomputed_tokens = 0;
  int64_t preemptions = 0;
  // The engine's step statistics, added up (what the worker's metrics count).
  int64_t step_prefill_tokens = 0;
  int64_t step_recomputed_tokens = 0;
};

constexpr int kTurns = 4;
constexpr int kMaxTokens = 6;

// Runs `sessions` conversations (and a fork of every other one after turn 0),
// each turn's requests submitted at once. Turn 1 and 3 are APPEND; turn 2 resends
// the whole history with FULL_CONTEXT, as a stateless client does.
RunLog RunWorkload(Engine* engine, kv::KvCacheManager* kv, int sessions, const model::SamplingConfig& base) {
  RunLog log;
  absl::Mutex mu;
  engine->SetStepCallback([&](const StepStats& s) {
    absl::MutexLock lock(&mu);
    log.step_prefill_tokens += s.prefill_tokens;
    log.step_recomputed_tokens += s.recomputed_tokens;
  });
  std::vector<std::string> ids;
  std::vector<std::vector<int32_t>> history;  // what each client has seen
  for (int i = 0; i < sessions; ++i) {
    ids.push_back(absl::StrCat("s", i));
    history.push_back({});
  }
  for (int turn = 0; turn < kTurns; ++turn) {
    if (turn == 1) {
      for (int i = 0; i < sessions; i += 2) {
        const std::string fork = absl::StrCat("s", i, "-fork");
        absl::Status st = engine->ForkSession(ids[i], fork, "t");
        EXPECT_TRUE(st.ok()) << st;
        ids.push_back(fork);
        history.push_back(history[i]);
      }
    }
    std::vector<std::unique_ptr<Collector>> collectors;
    std::vector<std::vector<int32_t>> inputs;
    for (size_t i = 0; i < ids.size(); ++i) {
      GenerateRequest r;
      r.session_id = ids[i];
      r.tenant = "t";
      r.max_tokens = kMaxTokens;
      r.sampling = base;
      if (base.temperature > 0) r.sampling.seed = base.seed * 1000 + i * 10 + turn;
      const int salt = static_cast<int>(i) * 5 + turn;
      std::vector<int32_t> add = turn == 0 ? Tokens(30 + static_cast<int>(i % 4) * 6, salt) : Tokens(5, salt);
      if (turn % 2 == 1) {
        r.mode = RequestMode::kAppend;
        r.input = add;
      } else {
        r.mode = RequestMode::kFullContext;
        r.input = history[i];
        r.input.insert(r.input.end(), add.begin(), add.end());
      }
      history[i].insert(history[i].end(), add.begin(), add.end());
      collectors.push_back(std::make_unique<Collector>());
      auto id = engine->Submit(std::move(r), collectors.back().get());
      EXPECT_TRUE(id.ok()) << ids[i] << ": " << id.status();
      if (!id.ok()) collectors.back()->OnDone(id.status(), {});
    }
    for (size_t i = 0; i < ids.size(); ++i) {
      Collector& c = *collectors[i];
      c.Wait();
      history[i].insert(history[i].end(), c.tokens.begin(), c.tokens.end());
      log.names.push_back(absl::StrCat(ids[i], "/", turn));
      log.outcomes.push_back(Outcome{c.status, c.tokens, c.result});
      log.recomputed_tokens += c.result.recomputed_tokens;
    }
    absl::Status inv = kv->CheckInvariants();
    EXPECT_TRUE(inv.ok()) << "after turn " << turn << ": " << inv;
  }
  log.preemptions = kv->GetStats().preemptions;
  // A request ends inside its last step, before that step's statistics are
  // handed over: idle, the engine has handed over every step's.
  EXPECT_TRUE(engine->WaitIdle(absl::Seconds(60)));
  engine->SetStepCallback(nullptr);
  for (const std::string& id : ids) {
    absl::Status st = engine->CloseSession(id, "t");
    EXPECT_TRUE(st.ok()) << id << ": " << st;
  }
  const kv::KvStats stats = kv->GetStats();
  EXPECT_EQ(stats.sessions, 0);
  EXPECT_EQ(stats.tier[0].session_private_pages + stats.tier[0].prefix_shared_pages, 0) << "leaked pages";
  EXPECT_EQ(stats.tier[1].session_private_pages, 0) << "leaked tier-1 pages";
  EXPECT_TRUE(kv->CheckInvariants().ok());
  return log;
}

// (tier-1 pages, sessions, sampling seed; 0 = greedy)
using Param = std::tuple<int, int, int>;

class EnginePressureTest : public ::testing::TestWithParam<Param> {};

TEST_P(EnginePressureTest, EveryReplyMatchesARoomyEngine) {
  const auto [tier1_pages, sessions, seed] = GetParam();
  model::SamplingConfig sampling;
  if (seed != 0) {
    sampling.temperature = 1.0f;
    sampling.seed = static_cast<uint64_t>(seed);
  }
  auto roomy = MakeEngineBed(/*tier0_pages=*/4096, /*tier1_pages=*/0);
  ASSERT_TRUE(roomy.ok()) << roomy.status();
  const RunLog want = RunWorkload(roomy->engine.get(), roomy->kv.get(), sessions, sampling);
  EXPECT_EQ(want.recomputed_tokens, 0);
  EXPECT_EQ(want.preemptions, 0);

  // The longest context is about 84 tokens (6 pages): tier 0 holds two of them.
  auto tight = MakeEngineBed(/*tier0_pages=*/12, tier1_pages);
  ASSERT_TRUE(tight.ok()) << tight.status();
  const RunLog got = RunWorkload(tight->engine.get(), tight->kv.get(), sessions, sampling);

  ASSERT_EQ(got.outcomes.size(), want.outcomes.size());
  int mismatches = 0;
  for (size_t i = 0; i < want.outcomes.size(); ++i) {
    const Outcome& w = want.outcomes[i];
    const Outcome& g = got.outcomes[i];
    ASSERT_TRUE(w.status.ok()) << want.names[i] << ": " << w.status;
    EXPECT_TRUE(g.status.ok()) << got.names[i] << ": " << g.status;
    if (g.tokens != w.tokens) ++mismatches;
    EXPECT_EQ(g.tokens, w.tokens) << got.names[i];
    EXPECT_EQ(g.result.finish, w.result.finish) << got.names[i];
    EXPECT_EQ(g.result.prompt_tokens, w.result.prompt_tokens) << got.names[i];
  }
  EXPECT_EQ(mismatches, 0);
  // Usage adds up: of each prompt, cached tokens and tokens computed the first
  // time; every token the engine prefilled is one of those, a recompute, or
  // the next token of a decode that a preemption turned into a prefill (at most
  // one a preemption). Under preemption a request used to count what it found
  // in the cache again as cached a second time (cached > prompt) and as
  // recomputed (more recomputed tokens than the engine prefilled).
  int64_t computed_first = 0;
  for (size_t i = 0; i < got.outcomes.size(); ++i) {
    const GenerateResult& r = got.outcomes[i].result;
    EXPECT_LE(r.cached_tokens, r.prompt_tokens) << got.names[i];
    computed_first += r.prompt_tokens - r.cached_tokens;
  }
  EXPECT_EQ(got.step_recomputed_tokens, got.recomputed_tokens);
  EXPECT_GE(got.step_prefill_tokens, computed_first + got.recomputed_tokens);
  EXPECT_LE(got.step_prefill_tokens, computed_first + got.recomputed_tokens + got.preemptions);
  std::printf(
      "tier1=%d pages, %d sessions, seed %d: %zu requests, %lld tokens recomputed, %lld preemptions\n",
      tier1_pages, sessions, seed, got.outcomes.size(), static_cast<long long>(got.recomputed_tokens),
      static_cast<long long>(got.preemptions));
  // With no room to offload a preempted session, the squeeze must recompute.
  // (Whether a squeeze happens depends on how many requests the engine thread
  // finds at once: on a loaded machine it can take them one by one.)
  if (tier1_pages == 0 && got.preemptions > 0) {
    EXPECT_GT(got.recomputed_tokens, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Budgets, EnginePressureTest,
                         ::testing::Combine(::testing::Values(0, 3, 64),  // tier 1: none, tiny, roomy
                                            ::testing::Values(8, 32),     // sessions at once
                                            ::testing::Values(0, 1, 7)),  // greedy, two seeds
                         [](const ::testing::TestParamInfo<Param>& info) {
                           return absl::StrCat("tier1_", std::get<0>(info.param), "_sessions_",
                                               std::get<1>(info.param), "_seed_", std::get<2>(info.param));
                         });

}  // namespace
}  // namespace kvcache::sched
