// libFuzzer harness: arbitrary bytes as the body of an OpenAI HTTP request
// (what any client can POST to the router's /v1/chat/completions or
// /v1/completions), through the JSON translation (router/openai_api.h), then
// the request validation and tokenisation a GenerateRequest meets next
// (service::ToEngineRequest, TokenizeInput), and the response side: the
// parsed text through the stop trimmer and every response builder. Must
// never crash; errors are INVALID_ARGUMENT with a message and a valid error
// object; an accepted request is FULL_CONTEXT with exactly one input and
// sampling within OpenAI's ranges.
//
// The first byte picks the endpoint and whether an x-session-id header is
// sent; the rest is the body. Seeds: tests/fuzz/corpus/openai/.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>

#include "common/input_tokens.h"
#include "nlohmann/json.hpp"
#include "router/openai_api.h"
#include "tests/fuzz/fuzz_env.h"
#include "worker/service/request_convert.h"

namespace {

namespace openai = kvcache::router::openai;

using kvcache::fuzz::Check;
using kvcache::fuzz::Env;
using kvcache::fuzz::GetEnv;

bool ValidJson(const std::string& s) { return nlohmann::json::accept(s); }

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const openai::Endpoint endpoint =
      (data[0] & 1) ? openai::Endpoint::kCompletions : openai::Endpoint::kChatCompletions;
  const std::optional<absl::string_view> header =
      (data[0] & 2) ? std::optional<absl::string_view>("session-from-header") : std::nullopt;
  const std::string body(reinterpret_cast<const char*>(data + 1), size - 1);

  auto parsed = openai::ParseRequest(endpoint, body, header);
  if (!parsed.ok()) {
    Check(parsed.status().code() == absl::StatusCode::kInvalidArgument, "a parse error that is not 400");
    Check(!parsed.status().message().empty(), "a parse error without a message");
    Check(ValidJson(openai::ErrorJson(parsed.status())), "the error object is not JSON");
    return 0;
  }
  const kvcache::v1::GenerateRequest& g = parsed->generate;
  Check(g.mode() == kvcache::v1::FULL_CONTEXT, "not FULL_CONTEXT");
  Check(endpoint == openai::Endpoint::kChatCompletions ? g.input().has_chat()
                                                       : (g.input().has_text() || g.input().has_tokens()),
        "the input kind does not match the endpoint");
  const auto& s = g.sampling();
  Check(s.temperature() >= 0 && s.temperature() <= 2, "temperature out of [0, 2]");
  Check(s.top_p() >= 0 && s.top_p() <= 1, "top_p out of [0, 1]");
  Check(s.max_tokens() >= 0 && s.top_k() >= 0, "negative max_tokens or top_k");
  Check(static_cast<size_t>(s.stop_size()) == parsed->stop.size(), "stop strings lost");
  for (const auto& stop : parsed->stop) Check(!stop.empty(), "an empty stop string");
  Check(!header.has_value() || g.session_id() == *header, "the x-session-id header was not used");

  // What the router and the worker do with it next.
  const Env& env = GetEnv();
  kvcache::v1::GenerateRequest req = g;
  req.set_tenant("fuzz");
  auto tokens = kvcache::TokenizeInput(req.input(), false, *env.tokenizer, &env.chat);
  if (tokens.ok()) Check(!tokens->empty(), "TokenizeInput accepted an input of zero tokens");
  auto engine = kvcache::service::ToEngineRequest(req, *env.tokenizer, &env.chat);
  if (!engine.ok()) Check(ValidJson(openai::ErrorJson(engine.status())), "the error object is not JSON");

  // The response side with the request's own text (any bytes the JSON held).
  std::string text = g.input().has_text() ? g.input().text() : "";
  if (g.input().has_chat()) {
    for (const auto& m : g.input().chat().messages()) text += m.content();
  }
  openai::StopTrimmer trimmer(parsed->stop);
  std::string out;
  for (size_t i = 0; i < text.size(); i += 3) out += trimmer.Push(text.substr(i, 3));
  out += trimmer.Flush();
  Check(out.size() <= text.size(), "the trimmer invented text");
  for (const auto& stop : parsed->stop) Check(out.find(stop) == std::string::npos, "a stop string got out");
  if (!trimmer.matched()) Check(out == text, "the trimmer lost text without a stop string");
  openai::ResponseMeta meta{endpoint, openai::NewResponseId(endpoint, size, data[0]), 1, parsed->model};
  kvcache::v1::GenerateResponse::Final final;
  final.set_session_id(g.session_id());
  const kvcache::v1::FinishReason finish = kvcache::v1::FINISH_REASON_STOP_STRING;
  Check(ValidJson(openai::ResponseJson(meta, out, finish, final)), "the response is not JSON");
  Check(ValidJson(openai::ChunkJson(meta, out, true, &finish, parsed->include_usage)), "a chunk is not JSON");
  Check(ValidJson(openai::UsageChunkJson(meta, final)), "the usage chunk is not JSON");
  Check(ValidJson(openai::ModelJson(parsed->model, 1)), "the model object is not JSON");
  return 0;
}
