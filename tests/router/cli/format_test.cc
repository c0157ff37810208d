#include "router/cli/format.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcache::cli {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

v1::GenerateResponse::Final MakeFinal(int prompt, int cached, int restored, int generated, int64_t ttft_us,
                                      int64_t total_us, v1::FinishReason reason) {
  v1::GenerateResponse::Final f;
  f.set_worker_id("w1");
  f.set_session_id("s");
  f.set_finish_reason(reason);
  f.set_predicted_cached_tokens(-1);
  v1::Usage* u = f.mutable_usage();
  u->set_prompt_tokens(prompt);
  u->set_cached_tokens(cached);
  u->set_restored_tokens(restored);
  u->set_generated_tokens(generated);
  u->set_time_to_first_token_us(ttft_us);
  u->set_total_time_us(total_us);
  return f;
}

TEST(CliFormatTest, DecodeRateCountsTokensAfterTheFirst) {
  // 11 tokens: 10 after the first, in 1 s after the first token.
  auto f = MakeFinal(10, 0, 0, 11, 50'000, 1'050'000, v1::FINISH_REASON_STOP);
  EXPECT_DOUBLE_EQ(DecodeTokensPerSecond(f.usage()), 10.0);
  EXPECT_EQ(DecodeTokensPerSecond(MakeFinal(10, 0, 0, 1, 50, 50, v1::FINISH_REASON_STOP).usage()), 0.0);
}

TEST(CliFormatTest, StatusLineShowsWorkerCacheTtftAndRate) {
  auto f = MakeFinal(150, 120, 0, 11, 35'200, 1'035'200, v1::FINISH_REASON_STOP);
  EXPECT_EQ(StatusLine(f), "[worker w1 | cached 120/150 tokens | ttft 35.2 ms | 10.0 tok/s]");
  auto g = MakeFinal(150, 120, 16, 11, 35'200, 1'035'200, v1::FINISH_REASON_LENGTH);
  EXPECT_THAT(StatusLine(g), HasSubstr("cached 120/150 tokens (16 restored)"));
  EXPECT_THAT(StatusLine(g), HasSubstr("| length]"));
}

TEST(CliFormatTest, UsageSummaryListsEveryField) {
  auto f = MakeFinal(150, 120, 16, 11, 35'200, 1'035'200, v1::FINISH_REASON_LENGTH);
  const std::string s = UsageSummary(f);
  for (const char* key : {"worker: w1", "session: s", "finish_reason: length", "prompt_tokens: 150",
                          "cached_tokens: 120", "restored_tokens: 16", "generated_tokens: 11",
                          "time_to_first_token: 35.2 ms", "total_time: 1035.2 ms"}) {
    EXPECT_THAT(s, HasSubstr(key));
  }
  // -1: not routed, so there is no prediction to show.
  EXPECT_THAT(s, Not(HasSubstr("predicted_cached_tokens")));
}

TEST(CliFormatTest, TableAlignsColumnsWithoutTrailingSpaces) {
  EXPECT_EQ(FormatTable({"A", "LONG"}, {{"xyz", "1"}, {"q", ""}}),
            "A    LONG\n"
            "xyz  1\n"
            "q\n");
}

TEST(CliFormatTest, SessionsTableIsSortedById) {
  v1::ListSessionsResponse r;
  for (const char* id : {"b", "a"}) {
    auto* s = r.add_sessions();
    s->set_session_id(id);
    s->set_worker_id("w1");
    s->set_state(v1::SESSION_IDLE);
    s->set_tokens_cached(42);
  }
  const std::string t = SessionsTable(r);
  EXPECT_LT(t.find("\na "), t.find("\nb "));
  EXPECT_THAT(t, HasSubstr("idle"));
  EXPECT_THAT(t, HasSubstr("42"));
}

TEST(CliFormatTest, WorkersTableShowsLoad) {
  v1::ListWorkersResponse r;
  auto* w = r.add_workers();
  w->set_worker_id("w1");
  w->set_address("127.0.0.1:1");
  w->set_health("SERVING");
  w->set_sessions(3);
  w->mutable_load()->set_pages_free_device(10);
  w->mutable_load()->set_pages_total_device(64);
  w->mutable_load()->set_running_requests(2);
  const std::string t = WorkersTable(r);
  EXPECT_THAT(t, HasSubstr("WORKER"));
  EXPECT_THAT(t, HasSubstr("SERVING"));
  EXPECT_THAT(t, HasSubstr("10/64"));
  // A worker the router cannot reach shows no load: its last report is old.
  w->set_health("DOWN");
  EXPECT_THAT(WorkersTable(r), Not(HasSubstr("10/64")));
}

}  // namespace
}  // namespace kvcache::cli
