// The chat loop against a scripted Generate: which mode and messages each turn
// sends, and how a lost session is recovered.
#include "router/cli/chat.h"

#include <sstream>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcache::cli {
namespace {

using ::testing::HasSubstr;

// Answers every call with "ok" tokens, except the statuses queued in `fail`.
struct FakeServer {
  std::vector<v1::GenerateRequest> requests;
  std::vector<absl::Status> fail;  // consumed front first; OK = answer
  int cut_after = 0;               // tokens streamed before a failure (the first one only)

  GenerateFn Fn() {
    return [this](const v1::GenerateRequest& req,
                  const std::function<void(const v1::GenerateResponse::Token&)>& on_token,
                  int* tokens_seen) -> absl::StatusOr<v1::GenerateResponse::Final> {
      requests.push_back(req);
      if (!fail.empty()) {
        absl::Status st = fail.front();
        fail.erase(fail.begin());
        if (!st.ok()) {
          for (int i = 0; i < cut_after; ++i) {
            v1::GenerateResponse::Token t;
            t.set_text("part");
            on_token(t);
            if (tokens_seen != nullptr) *tokens_seen = i + 1;
          }
          cut_after = 0;
          return st;
        }
      }
      v1::GenerateResponse::Token t;
      t.set_text("ok");
      on_token(t);
      if (tokens_seen != nullptr) *tokens_seen = 1;
      v1::GenerateResponse::Final f;
      f.set_worker_id("w1");
      f.mutable_usage()->set_prompt_tokens(10);
      f.set_finish_reason(v1::FINISH_REASON_STOP);
      return f;
    };
  }
};

ChatOptions Options() {
  ChatOptions o;
  o.session_id = "s1";
  o.system_prompt = "be brief";
  return o;
}

TEST(CliChatTest, FirstTurnFullContextThenAppend) {
  FakeServer server;
  std::istringstream in("hello\n\n  second  \n/quit\nnever sent\n");
  std::ostringstream out, err;
  ChatResult r = RunChat(Options(), server.Fn(), in, out, err);
  EXPECT_EQ(r.turns, 2);
  EXPECT_EQ(r.failed_turns, 0);
  ASSERT_EQ(server.requests.size(), 2u);
  const auto& first = server.requests[0];
  EXPECT_EQ(first.session_id(), "s1");
  EXPECT_EQ(first.mode(), v1::FULL_CONTEXT);
  ASSERT_EQ(first.input().chat().messages_size(), 2);
  EXPECT_EQ(first.input().chat().messages(0).role(), "system");
  EXPECT_EQ(first.input().chat().messages(1).content(), "hello");
  const auto& second = server.requests[1];
  EXPECT_EQ(second.mode(), v1::APPEND);
  ASSERT_EQ(second.input().chat().messages_size(), 1);
  EXPECT_EQ(second.input().chat().messages(0).role(), "user");
  EXPECT_EQ(second.input().chat().messages(0).content(), "second");
  EXPECT_EQ(out.str(), "ok\nok\n");
  EXPECT_THAT(err.str(), HasSubstr("[worker w1 | cached 0/10 tokens"));
}

TEST(CliChatTest, LostSessionIsResentAsFullContext) {
  FakeServer server;
  server.fail = {absl::OkStatus(), absl::NotFoundError("session s1 not found")};
  std::istringstream in("hello\nsecond\n");
  std::ostringstream out, err;
  ChatResult r = RunChat(Options(), server.Fn(), in, out, err);
  EXPECT_EQ(r.turns, 2);
  EXPECT_EQ(r.failed_turns, 0);
  ASSERT_EQ(server.requests.size(), 3u);
  EXPECT_EQ(server.requests[1].mode(), v1::APPEND);
  const auto& resent = server.requests[2];
  EXPECT_EQ(resent.mode(), v1::FULL_CONTEXT);
  // system, user, assistant reply, new user message.
  ASSERT_EQ(resent.input().chat().messages_size(), 4);
  EXPECT_EQ(resent.input().chat().messages(2).role(), "assistant");
  EXPECT_EQ(resent.input().chat().messages(2).content(), "ok");
  EXPECT_EQ(resent.input().chat().messages(3).content(), "second");
  EXPECT_THAT(err.str(), HasSubstr("resending the conversation"));
}

TEST(CliChatTest, OtherErrorsFailTheTurnAndTheChatGoesOn) {
  FakeServer server;
  server.fail = {absl::InvalidArgumentError("bad")};
  std::istringstream in("hello\nagain\n");
  std::ostringstream out, err;
  ChatResult r = RunChat(Options(), server.Fn(), in, out, err);
  EXPECT_EQ(r.turns, 1);
  EXPECT_EQ(r.failed_turns, 1);
  ASSERT_EQ(server.requests.size(), 2u);
  // The failed turn never reached the server's context: the next is FULL_CONTEXT
  // again, without the failed message.
  EXPECT_EQ(server.requests[1].mode(), v1::FULL_CONTEXT);
  ASSERT_EQ(server.requests[1].input().chat().messages_size(), 2);
  EXPECT_EQ(server.requests[1].input().chat().messages(1).content(), "again");
  EXPECT_THAT(err.str(), HasSubstr("error: INVALID_ARGUMENT: bad"));
}

// A reply cut after tokens (a deadline, or Ctrl-C's cancel) stays in the
// conversation as the user saw it: the next APPEND says how much was read
// (tokens_read), and a resend after a lost session carries the cut turn.
// Before, the next turn resent the history without it, as FULL_CONTEXT, and
// the model forgot what the user had been shown.
TEST(CliChatTest, AReplyCutAfterTokensStaysInTheConversation) {
  FakeServer server;
  server.fail = {absl::DeadlineExceededError("deadline")};
  server.cut_after = 3;
  std::istringstream in("hello\nsecond\nthird\n");
  std::ostringstream out, err;
  ChatResult r = RunChat(Options(), server.Fn(), in, out, err);
  EXPECT_EQ(r.failed_turns, 1);
  ASSERT_EQ(server.requests.size(), 3u);
  EXPECT_EQ(server.requests[1].mode(), v1::APPEND);
  EXPECT_EQ(server.requests[1].tokens_read(), 3);
  EXPECT_EQ(server.requests[1].input().chat().messages(0).content(), "second");
  // A turn answered in full reads all of it: no tokens_read after it.
  EXPECT_EQ(server.requests[2].mode(), v1::APPEND);
  EXPECT_FALSE(server.requests[2].has_tokens_read());

  // A cancel after tokens ("stop generating") is no failure; the session is
  // lost before the next turn, which resends every turn the user saw.
  FakeServer again;
  again.fail = {absl::CancelledError("stopped"), absl::NotFoundError("session s1 not found")};
  again.cut_after = 2;
  std::istringstream in2("hello\nsecond\n");
  std::ostringstream out2, err2;
  ChatResult r2 = RunChat(Options(), again.Fn(), in2, out2, err2);
  EXPECT_EQ(r2.failed_turns, 0);
  EXPECT_EQ(r2.turns, 2);
  ASSERT_EQ(again.requests.size(), 3u);
  EXPECT_EQ(again.requests[1].tokens_read(), 2);
  const auto& resent = again.requests[2];
  EXPECT_EQ(resent.mode(), v1::FULL_CONTEXT);
  ASSERT_EQ(resent.input().chat().messages_size(), 4);
  EXPECT_EQ(resent.input().chat().messages(1).content(), "hello");
  EXPECT_EQ(resent.input().chat().messages(2).content(), "partpart");
  EXPECT_EQ(resent.input().chat().messages(3).content(), "second");
  EXPECT_THAT(err2.str(), HasSubstr("[stopped]"));
}

TEST(CliChatTest, ResumeAppendsFromTheFirstTurn) {
  FakeServer server;
  ChatOptions o = Options();
  o.resume = true;
  std::istringstream in("continue\n");
  std::ostringstream out, err;
  RunChat(o, server.Fn(), in, out, err);
  ASSERT_EQ(server.requests.size(), 1u);
  EXPECT_EQ(server.requests[0].mode(), v1::APPEND);
}

}  // namespace
}  // namespace kvcache::cli
