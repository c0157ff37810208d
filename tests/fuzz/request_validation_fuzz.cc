// libFuzzer harness: arbitrary bytes parsed as a kvcache.v1.GenerateRequest
// (what any client can put on the wire) and run through the worker's request
// validation (service::ToEngineRequest) and the tokenisation the router and the
// worker share (TokenizeInput), with the tiny test model's tokenizer and the
// ChatML template. Must never crash; an accepted request must respect the
// documented limits.
//
// Seeds: KVCACHE_FUZZ_WRITE_SEEDS=DIR ./request_validation_fuzz writes a few
// valid serialized requests into DIR and exits (tests/fuzz/corpus/request/).
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>

#include "common/input_tokens.h"
#include "kvcache/v1/common.pb.h"
#include "tests/fuzz/fuzz_env.h"
#include "worker/service/request_convert.h"

namespace {

using kvcache::v1::GenerateRequest;

using kvcache::fuzz::Check;
using kvcache::fuzz::Env;
using kvcache::fuzz::GetEnv;

void WriteSeeds(const std::string& dir) {
  auto write = [&](const std::string& name, const GenerateRequest& r) {
    std::ofstream(dir + "/" + name, std::ios::binary) << r.SerializeAsString();
  };
  GenerateRequest text;
  text.set_session_id("user-1");
  text.set_mode(kvcache::v1::FULL_CONTEXT);
  text.mutable_input()->set_text("<|im_start|>user\nhello there<|im_end|>\n");
  text.mutable_sampling()->set_max_tokens(16);
  text.mutable_sampling()->add_stop("\n\n");
  text.mutable_sampling()->set_temperature(0.7f);
  text.mutable_sampling()->set_top_p(0.9f);
  text.mutable_sampling()->set_top_k(40);
  write("text", text);

  GenerateRequest tokens;
  tokens.set_mode(kvcache::v1::APPEND);
  tokens.set_session_id("user-1");
  for (int id : {1, 2, 72, 101, 108, 108, 111, 0}) tokens.mutable_input()->mutable_tokens()->add_ids(id);
  tokens.mutable_sampling()->add_stop_token_ids(0);
  tokens.mutable_sampling()->set_ignore_eos(true);
  tokens.set_pin(true);
  write("tokens", tokens);

  GenerateRequest chat;
  chat.set_session_id("chat.2:x-y_z");
  auto* c = chat.mutable_input()->mutable_chat();
  for (const char* role : {"system", "user", "assistant", "user"}) {
    auto* m = c->add_messages();
    m->set_role(role);
    m->set_content(std::string("a message from ") + role + " \xc3\xa9\xe2\x82\xac");
  }
  c->set_add_generation_prompt(false);
  chat.set_stream_text(false);
  chat.set_tenant("tenant-a");
  write("chat", chat);

  GenerateRequest append_chat = chat;
  append_chat.set_mode(kvcache::v1::APPEND);
  write("append_chat", append_chat);

  GenerateRequest going_on;  // a router going on a cut reply
  going_on.set_mode(kvcache::v1::APPEND);
  going_on.set_session_id("user-1");
  going_on.set_continued_tokens(12);
  going_on.set_request_id("0123456789abcdef0123456789abcdef");
  write("going_on", going_on);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  if (const char* dir = std::getenv("KVCACHE_FUZZ_WRITE_SEEDS")) {
    WriteSeeds(dir);
    std::exit(0);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  GenerateRequest req;
  if (!req.ParseFromArray(data, static_cast<int>(size))) return 0;
  const Env& env = GetEnv();
  for (const kvcache::tok::ChatTemplate* chat :
       {&env.chat, static_cast<const kvcache::tok::ChatTemplate*>(nullptr)}) {
    for (bool append : {false, true}) {
      auto tokens = kvcache::TokenizeInput(req.input(), append, *env.tokenizer, chat);
      if (tokens.ok()) Check(!tokens->empty(), "TokenizeInput accepted an input of zero tokens");
      if (!tokens.ok()) Check(!tokens.status().message().empty(), "TokenizeInput error without a message");
    }
    auto out = kvcache::service::ToEngineRequest(req, *env.tokenizer, chat);
    if (!out.ok()) {
      Check(out.status().code() == absl::StatusCode::kInvalidArgument ||
                out.status().code() == absl::StatusCode::kFailedPrecondition,
            "ToEngineRequest failed with a code other than INVALID_ARGUMENT / FAILED_PRECONDITION");
      Check(!out.status().message().empty(), "ToEngineRequest error without a message");
      continue;
    }
    // Only an APPEND that goes on its session's cut reply has no input, and it
    // names that request and drops nothing itself.
    const bool goes_on = out->mode == kvcache::sched::RequestMode::kAppend && out->continued > 0;
    Check(!out->input.empty() || goes_on, "accepted a request without input tokens");
    Check(!goes_on || (out->input.empty() && out->tokens_read < 0),
          "a continuation with input or tokens_read");
    Check(out->continued >= 0 && (goes_on || out->continued <= static_cast<int64_t>(out->input.size())),
          "continued outside its input");
    Check(out->request_id.size() <= kvcache::service::kMaxRequestIdBytes, "request_id length");
    Check(out->stop.size() <= static_cast<size_t>(kvcache::service::kMaxStopStrings),
          "too many stop strings");
    for (const std::string& s : out->stop) {
      Check(!s.empty() && s.size() <= static_cast<size_t>(kvcache::service::kMaxStopStringBytes),
            "stop string length");
    }
    Check(out->session_id.empty() ? out->mode != kvcache::sched::RequestMode::kAppend
                                  : kvcache::ValidateSessionId(out->session_id).ok(),
          "accepted a bad session id");
    Check(!out->tenant.empty(), "empty tenant");
    Check(out->sampling.seed != 0, "zero seed");
  }
  return 0;
}
