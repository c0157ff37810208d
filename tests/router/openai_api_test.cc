// The OpenAI JSON ⇄ kvcache translation (router/openai_api.h), without I/O.
#include "router/openai_api.h"

#include <optional>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace kvcache::router::openai {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using Json = nlohmann::json;

absl::StatusOr<ParsedRequest> Chat(const std::string& body,
                                   std::optional<absl::string_view> session_header = std::nullopt) {
  return ParseRequest(Endpoint::kChatCompletions, body, session_header);
}
absl::StatusOr<ParsedRequest> Completion(const std::string& body) {
  return ParseRequest(Endpoint::kCompletions, body, std::nullopt);
}

TEST(OpenAiParseTest, ChatMessagesBecomeAFullContextChatInput) {
  auto r = Chat(R"({"model": "m", "messages": [
      {"role": "developer", "content": "be brief"},
      {"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]},
      {"role": "assistant", "content": null},
      {"role": "user", "content": "again", "name": "bob"}],
    "max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "seed": 42, "stop": "\n\n",
    "stream": true, "stream_options": {"include_usage": true}, "some_future_field": [1, 2]})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->model, "m");
  EXPECT_TRUE(r->stream);
  EXPECT_TRUE(r->include_usage);
  const v1::GenerateRequest& g = r->generate;
  EXPECT_EQ(g.mode(), v1::FULL_CONTEXT);
  EXPECT_EQ(g.session_id(), "");  // no key: placed by prefix alone, ephemeral
  ASSERT_TRUE(g.input().has_chat());
  ASSERT_EQ(g.input().chat().messages_size(), 4);
  EXPECT_EQ(g.input().chat().messages(0).role(), "system");
  EXPECT_EQ(g.input().chat().messages(0).content(), "be brief");
  EXPECT_EQ(g.input().chat().messages(1).content(), "hello\nthere");
  EXPECT_EQ(g.input().chat().messages(2).content(), "");
  EXPECT_FALSE(g.input().chat().has_add_generation_prompt());  // default: true
  EXPECT_EQ(g.sampling().max_tokens(), 7);
  EXPECT_FLOAT_EQ(g.sampling().temperature(), 0.5f);
  EXPECT_FLOAT_EQ(g.sampling().top_p(), 0.9f);
  EXPECT_EQ(g.sampling().seed(), 42u);
  EXPECT_THAT(g.sampling().stop(), ElementsAre("\n\n"));
  EXPECT_THAT(r->stop, ElementsAre("\n\n"));
}

TEST(OpenAiParseTest, DefaultsFollowOpenAi) {
  auto r = Chat(R"({"messages": [{"role": "user", "content": "hi"}], "max_tokens": null, "stop": null})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->model, "");
  EXPECT_FALSE(r->stream);
  EXPECT_FLOAT_EQ(r->generate.sampling().temperature(), 1.0f);  // OpenAI's default, not greedy
  EXPECT_EQ(r->generate.sampling().max_tokens(), 0);            // the server's default
  EXPECT_EQ(r->generate.sampling().seed(), 0u);
  EXPECT_TRUE(r->stop.empty());
}

TEST(OpenAiParseTest, MaxCompletionTokensAndIntegralFloats) {
  auto r = Chat(R"({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 16.0})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->generate.sampling().max_tokens(), 16);
}

TEST(OpenAiParseTest, SeedZeroIsStillAnExplicitSeed) {
  auto zero = Chat(R"({"messages": [{"role": "user", "content": "hi"}], "seed": 0})");
  auto negative = Chat(R"({"messages": [{"role": "user", "content": "hi"}], "seed": -1})");
  ASSERT_TRUE(zero.ok() && negative.ok());
  EXPECT_NE(zero->generate.sampling().seed(), 0u);  // 0 on the wire would mean "from the session id"
  EXPECT_EQ(negative->generate.sampling().seed(), ~0ull);
}

TEST(OpenAiParseTest, SessionKeyPrecedence) {
  const std::string body =
      R"({"messages": [{"role": "user", "content": "hi"}], "user": "alice", "prompt_cache_key": "conv-7"})";
  EXPECT_EQ(Chat(body, "from-header")->generate.session_id(), "from-header");
  EXPECT_EQ(Chat(body)->generate.session_id(), "conv-7");
  // A header present but empty names no session: refused, not taken as absent.
  EXPECT_EQ(Chat(body, "").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      Chat(R"({"messages": [{"role": "user", "content": "hi"}], "user": "alice"})")->generate.session_id(),
      "alice");
  // Free text that is no session id becomes a stable one.
  auto email = Chat(R"({"messages": [{"role": "user", "content": "hi"}], "user": "alice@example.com"})");
  ASSERT_TRUE(email.ok());
  EXPECT_EQ(email->generate.session_id(), SessionIdForKey("alice@example.com"));
  EXPECT_THAT(email->generate.session_id(), ::testing::MatchesRegex("k-[0-9a-f]{32}"));
  EXPECT_NE(SessionIdForKey("a b"), SessionIdForKey("a c"));
  EXPECT_EQ(SessionIdForKey(std::string(129, 'x')).size(), 34u);
}

TEST(OpenAiParseTest, CompletionPrompts) {
  auto text = Completion(R"({"prompt": "once upon"})");
  ASSERT_TRUE(text.ok());
  EXPECT_EQ(text->generate.input().text(), "once upon");
  auto one = Completion(R"({"prompt": ["once upon"]})");
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(one->generate.input().text(), "once upon");
  auto ids = Completion(R"({"prompt": [1, 2, 3]})");
  ASSERT_TRUE(ids.ok());
  EXPECT_THAT(ids->generate.input().tokens().ids(), ElementsAre(1, 2, 3));
  auto nested = Completion(R"({"prompt": [[4, 5]]})");
  ASSERT_TRUE(nested.ok());
  EXPECT_THAT(nested->generate.input().tokens().ids(), ElementsAre(4, 5));
}

TEST(OpenAiParseTest, BadInputIsInvalidArgumentNamingTheField) {
  struct Case {
    Endpoint endpoint;
    std::string body;
    std::string param;
    std::string message;
  };
  const Case cases[] = {
      {Endpoint::kChatCompletions, "{", "", "not valid JSON"},
      {Endpoint::kChatCompletions, "[1]", "", "JSON object"},
      {Endpoint::kChatCompletions, R"({"model": "m"})", "messages", "required"},
      {Endpoint::kChatCompletions, R"({"messages": []})", "messages", "non-empty"},
      {Endpoint::kChatCompletions, R"({"messages": [{"role": "tool", "content": "x"}]})", "messages[0]",
       "role"},
      {Endpoint::kChatCompletions, R"({"messages": [{"content": "x"}]})", "messages[0]", "role"},
      {Endpoint::kChatCompletions, R"({"messages": [{"role": "user", "content": 5}]})", "messages[0]",
       "content"},
      {Endpoint::kChatCompletions,
       R"({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]})",
       "messages[0]", "text"},
      {Endpoint::kChatCompletions,
       R"({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"})", "temperature", "number"},
      {Endpoint::kChatCompletions, R"({"messages": [{"role": "user", "content": "x"}], "temperature": 3})",
       "temperature", "[0, 2]"},
      {Endpoint::kChatCompletions, R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0})",
       "max_tokens", "at least 1"},
      {Endpoint::kChatCompletions, R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": 1.5})",
       "max_tokens", "integer"},
      {Endpoint::kChatCompletions, R"({"messages": [{"role": "user", "content": "x"}], "stream": "yes"})",
       "stream", "boolean"},
      {Endpoint::kChatCompletions, R"({"messages": [{"role": "user", "content": "x"}], "stop": [1]})", "stop",
       "strings"},
      {Endpoint::kChatCompletions, R"({"messages": [{"role": "user", "content": "x"}], "stop": ""})", "stop",
       "empty"},
      {Endpoint::kChatCompletions, R"({"messages": [{"role": "user", "content": "x"}], "n": 2})", "n", "1"},
      {Endpoint::kChatCompletions, R"({"messages": [{"role": "user", "content": "x"}], "logprobs": true})",
       "logprobs", "not supported"},
      {Endpoint::kChatCompletions,
       R"({"messages": [{"role": "user", "content": "x"}], "presence_penalty": 0.5})", "presence_penalty",
       "not supported"},
      {Endpoint::kChatCompletions, R"({"messages": [{"role": "user", "content": "x"}], "user": 7})", "user",
       "string"},
      // A missing content was an empty turn (a client's misnamed field unnoticed).
      {Endpoint::kChatCompletions, R"({"messages": [{"role": "user"}]})", "messages[0]", "content"},
      {Endpoint::kChatCompletions, R"({"messages": [{"role": "system", "content": null}]})", "messages[0]",
       "content"},
      // vLLM's extras that kvcache does not apply were dropped silently.
      {Endpoint::kChatCompletions,
       R"({"messages": [{"role": "user", "content": "x"}], "repetition_penalty": 1.3})", "repetition_penalty",
       "not supported"},
      {Endpoint::kCompletions, R"({"prompt": "x", "min_p": 0.2})", "min_p", "not supported"},
      {Endpoint::kCompletions, R"({"prompt": ["a", "b"]})", "prompt", "several"},
      {Endpoint::kCompletions, R"({"prompt": [-1]})", "prompt", "token id"},
      {Endpoint::kCompletions, R"({"prompt": {}})", "prompt", "string"},
      {Endpoint::kCompletions, R"({"prompt": "x", "echo": true})", "echo", "not supported"},
      // The legacy API's logprobs counts alternatives: 0 still asks for the
      // sampled tokens' log probabilities.
      {Endpoint::kCompletions, R"({"prompt": "x", "logprobs": 0})", "logprobs", "not supported"},
      {Endpoint::kChatCompletions,
       R"({"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 2})", "logprobs",
       "not supported"},
  };
  for (const Case& c : cases) {
    auto r = ParseRequest(c.endpoint, c.body, std::nullopt);
    ASSERT_FALSE(r.ok()) << c.body;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.body;
    EXPECT_EQ(ParamOf(r.status()), c.param) << c.body;
    EXPECT_THAT(r.status().message(), HasSubstr(c.message)) << c.body;
  }
}

TEST(OpenAiParseTest, DefaultValuedUnsupportedFieldsAreAccepted) {
  auto r =
      Chat(R"({"messages": [{"role": "user", "content": "x"}], "n": 1, "logprobs": false, "top_logprobs": 0,
                    "presence_penalty": 0, "frequency_penalty": 0.0, "tools": [], "logit_bias": {},
                    "response_format": {"type": "text"}, "echo": false, "repetition_penalty": 1, "min_p": 0})");
  EXPECT_TRUE(r.ok()) << r.status();
}

TEST(OpenAiStatusTest, HttpStatusTable) {
  EXPECT_EQ(HttpStatusFor(absl::StatusCode::kInvalidArgument), 400);
  EXPECT_EQ(HttpStatusFor(absl::StatusCode::kUnauthenticated), 401);
  EXPECT_EQ(HttpStatusFor(absl::StatusCode::kPermissionDenied), 403);
  EXPECT_EQ(HttpStatusFor(absl::StatusCode::kNotFound), 404);
  EXPECT_EQ(HttpStatusFor(absl::StatusCode::kAborted), 409);
  EXPECT_EQ(HttpStatusFor(absl::StatusCode::kResourceExhausted), 429);
  EXPECT_EQ(HttpStatusFor(absl::StatusCode::kUnavailable), 503);
  EXPECT_EQ(HttpStatusFor(absl::StatusCode::kDeadlineExceeded), 504);
  EXPECT_EQ(HttpStatusFor(absl::StatusCode::kInternal), 500);
  EXPECT_EQ(HttpStatusFor(absl::StatusCode::kDataLoss), 500);
}

TEST(OpenAiStatusTest, ErrorObject) {
  auto bad = Chat(R"({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"})");
  Json e = Json::parse(ErrorJson(bad.status()));
  EXPECT_EQ(e["error"]["type"], "invalid_request_error");
  EXPECT_EQ(e["error"]["param"], "temperature");
  EXPECT_EQ(e["error"]["code"], "invalid_argument");
  EXPECT_THAT(e["error"]["message"].get<std::string>(), HasSubstr("temperature"));
  Json quota = Json::parse(ErrorJson(absl::ResourceExhaustedError("tenant over quota")));
  EXPECT_EQ(quota["error"]["type"], "rate_limit_error");
  EXPECT_TRUE(quota["error"]["param"].is_null());
  EXPECT_EQ(quota["error"]["message"], "tenant over quota");
  Json model = Json::parse(ErrorJson(absl::NotFoundError("no such model"), "model_not_found"));
  EXPECT_EQ(model["error"]["code"], "model_not_found");
}

v1::GenerateResponse::Final SomeFinal() {
  v1::GenerateResponse::Final f;
  v1::Usage& u = *f.mutable_usage();
  u.set_prompt_tokens(120);
  u.set_cached_tokens(96);
  u.set_generated_tokens(8);
  u.set_time_to_first_token_us(2500);
  f.set_worker_id("w1");
  f.set_session_id("alice");
  f.set_predicted_cached_tokens(80);
  return f;
}

TEST(OpenAiResponseTest, ChatCompletionObject) {
  ResponseMeta meta{Endpoint::kChatCompletions, NewResponseId(Endpoint::kChatCompletions, 1, 2), 1700000000,
                    "m"};
  EXPECT_THAT(meta.id, ::testing::MatchesRegex("chatcmpl-[0-9a-f]{24}"));
  Json j = Json::parse(ResponseJson(meta, "Hello!", v1::FINISH_REASON_LENGTH, SomeFinal()));
  EXPECT_EQ(j["object"], "chat.completion");
  EXPECT_EQ(j["id"], meta.id);
  EXPECT_EQ(j["created"], 1700000000);
  EXPECT_EQ(j["model"], "m");
  EXPECT_EQ(j["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(j["choices"][0]["message"]["content"], "Hello!");
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(j["usage"]["prompt_tokens"], 120);
  EXPECT_EQ(j["usage"]["completion_tokens"], 8);
  EXPECT_EQ(j["usage"]["total_tokens"], 128);
  EXPECT_EQ(j["usage"]["prompt_tokens_details"]["cached_tokens"], 96);
  EXPECT_EQ(j["kvcache"]["worker_id"], "w1");
  EXPECT_EQ(j["kvcache"]["session_id"], "alice");
  EXPECT_DOUBLE_EQ(j["kvcache"]["time_to_first_token_ms"].get<double>(), 2.5);
  EXPECT_EQ(j["kvcache"]["predicted_cached_tokens"], 80);
}

TEST(OpenAiResponseTest, TextCompletionAndChunks) {
  ResponseMeta meta{Endpoint::kCompletions, NewResponseId(Endpoint::kCompletions, 3, 4), 5, "m"};
  EXPECT_THAT(meta.id, ::testing::MatchesRegex("cmpl-[0-9a-f]{24}"));
  Json full = Json::parse(ResponseJson(meta, "abc", v1::FINISH_REASON_STOP_STRING, SomeFinal()));
  EXPECT_EQ(full["object"], "text_completion");
  EXPECT_EQ(full["choices"][0]["text"], "abc");
  EXPECT_EQ(full["choices"][0]["finish_reason"], "stop");
  Json chunk = Json::parse(ChunkJson(meta, "ab", false, nullptr, false));
  EXPECT_EQ(chunk["choices"][0]["text"], "ab");
  EXPECT_TRUE(chunk["choices"][0]["finish_reason"].is_null());
  EXPECT_FALSE(chunk.contains("usage"));

  ResponseMeta chat{Endpoint::kChatCompletions, "chatcmpl-x", 5, "m"};
  Json first = Json::parse(ChunkJson(chat, "", true, nullptr, true));
  EXPECT_EQ(first["object"], "chat.completion.chunk");
  EXPECT_EQ(first["choices"][0]["delta"]["role"], "assistant");
  EXPECT_EQ(first["choices"][0]["delta"]["content"], "");
  EXPECT_TRUE(first.contains("usage") && first["usage"].is_null());
  const v1::FinishReason stop = v1::FINISH_REASON_STOP;
  Json last = Json::parse(ChunkJson(chat, "", false, &stop, true));
  EXPECT_TRUE(last["choices"][0]["delta"].empty());
  EXPECT_EQ(last["choices"][0]["finish_reason"], "stop");
  Json usage = Json::parse(UsageChunkJson(chat, SomeFinal()));
  EXPECT_TRUE(usage["choices"].empty());
  EXPECT_EQ(usage["usage"]["prompt_tokens_details"]["cached_tokens"], 96);
  EXPECT_EQ(usage["kvcache"]["worker_id"], "w1");
}

TEST(OpenAiResponseTest, InvalidUtf8IsReplacedNotThrown) {
  ResponseMeta meta{Endpoint::kCompletions, "cmpl-x", 5, "m"};
  Json j = Json::parse(ChunkJson(meta,
                                 std::string("a\xff"
                                             "b"),
                                 false, nullptr, false));
  EXPECT_EQ(j["choices"][0]["text"],
            "a\xEF\xBF\xBD"
            "b");
}

TEST(OpenAiResponseTest, Models) {
  Json list = Json::parse(ModelsJson({"a", "b"}, 9));
  EXPECT_EQ(list["object"], "list");
  ASSERT_EQ(list["data"].size(), 2u);
  EXPECT_EQ(list["data"][1]["id"], "b");
  EXPECT_EQ(list["data"][1]["object"], "model");
  EXPECT_EQ(Json::parse(ModelJson("a", 9))["id"], "a");
}

TEST(StopTrimmerTest, CutsBeforeTheStopStringAcrossDeltas) {
  StopTrimmer t({"END", "\n\n"});
  std::string out;
  out += t.Push("Hello E");
  EXPECT_EQ(out, "Hello ");  // "E" may start END
  out += t.Push("N");
  EXPECT_EQ(out, "Hello ");
  out += t.Push("Dless");  // completes END, and more after it in the same token
  EXPECT_TRUE(t.matched());
  out += t.Push("more");
  out += t.Flush();
  EXPECT_EQ(out, "Hello ");
}

TEST(StopTrimmerTest, ReleasesWhatTurnsOutNotToBeAStop) {
  StopTrimmer t({"END"});
  std::string out = t.Push("the EN");
  EXPECT_EQ(out, "the ");
  out += t.Push("gine");
  EXPECT_EQ(out, "the ENgine");
  out += t.Push(" E");
  out += t.Flush();  // the stream ended: the held "E" goes out
  EXPECT_EQ(out, "the ENgine E");
  EXPECT_FALSE(t.matched());
}

TEST(StopTrimmerTest, EarliestStopWinsAndNoStopsPassThrough) {
  StopTrimmer t({"bc", "a"});
  EXPECT_EQ(t.Push("xxabc"), "xx");
  StopTrimmer none({});
  EXPECT_EQ(none.Push("abc"), "abc");
  EXPECT_EQ(none.Flush(), "");
}

}  // namespace
}  // namespace kvcache::router::openai
