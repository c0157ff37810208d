#include "worker/service/request_convert.h"

#include <xxhash.h>

#include "absl/random/distributions.h"
#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "common/input_tokens.h"

namespace kvcache::service {

v1::FinishReason ToProto(sched::FinishReason reason) {
  switch (reason) {
    case sched::FinishReason::kStop:
      return v1::FINISH_REASON_STOP;
    case sched::FinishReason::kLength:
      return v1::FINISH_REASON_LENGTH;
    case sched::FinishReason::kStopString:
      return v1::FINISH_REASON_STOP_STRING;
    case sched::FinishReason::kContextFull:
      return v1::FINISH_REASON_CONTEXT_FULL;
  }
  return v1::FINISH_REASON_UNSPECIFIED;
}

absl::StatusOr<sched::GenerateRequest> ToEngineRequest(const v1::GenerateRequest& request,
                                                       const tok::Tokenizer& tokenizer,
                                                       const tok::ChatTemplate* chat_template) {
  sched::GenerateRequest out;
  out.mode = request.mode() == v1::APPEND ? sched::RequestMode::kAppend : sched::RequestMode::kFullContext;
  if (request.mode() != v1::MODE_UNSPECIFIED && request.mode() != v1::FULL_CONTEXT &&
      request.mode() != v1::APPEND) {
    return absl::InvalidArgumentError(absl::StrCat("unknown mode ", request.mode()));
  }
  if (!request.session_id().empty()) {
    absl::Status st = ValidateSessionId(request.session_id());
    if (!st.ok()) return st;
  } else if (out.mode == sched::RequestMode::kAppend) {
    return absl::InvalidArgumentError("APPEND mode needs a session_id");
  }
  out.session_id = request.session_id();
  out.tenant = TenantOf(request.tenant());
  if (request.request_id().size() > kMaxRequestIdBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("request_id is ", request.request_id().size(), " bytes; at most ", kMaxRequestIdBytes));
  }
  out.request_id = request.request_id();
  const bool append = out.mode == sched::RequestMode::kAppend;

  // An APPEND that goes on its session's cut reply (continued_tokens, from a
  // router) has no input of its own.
  const bool goes_on = append && request.continued_tokens() > 0;
  if (goes_on) {
    if (request.input().kind_case() != v1::Input::KIND_NOT_SET || request.has_tokens_read()) {
      return absl::InvalidArgumentError(
          absl::StrCat("continued_tokens ", request.continued_tokens(),
                       " with APPEND goes on the session's last reply: set no input and no tokens_read"));
    }
  } else {
    auto tokens = TokenizeInput(request.input(), append, tokenizer, chat_template);
    if (!tokens.ok()) return tokens.status();
    out.input = std::move(*tokens);
  }
  if (append && request.input().has_chat() && chat_template != nullptr) {
    tok::EncodeOptions encode;
    encode.add_special = false;
    encode.parse_special = true;
    out.close_turn = tokenizer.Encode(chat_template->EndOfTurn(), encode);
  }

  const v1::SamplingParams& s = request.sampling();
  out.sampling.temperature = s.temperature();
  out.sampling.top_k = s.top_k();
  out.sampling.top_p = s.top_p() == 0.0f ? 1.0f : s.top_p();
  out.sampling.seed = s.seed();
  if (out.sampling.seed == 0) {
    // Reproducible per session: derived from the id. A request without a
    // session samples at random, as an unseeded request does elsewhere.
    const std::string& id = request.session_id();
    out.sampling.seed =
        id.empty() ? absl::Uniform<uint64_t>(absl::BitGen()) | 1 : XXH3_64bits(id.data(), id.size()) | 1;
  }
  out.max_tokens = s.max_tokens();
  if (s.stop_size() > kMaxStopStrings) {
    return absl::InvalidArgumentError(absl::StrCat("at most ", kMaxStopStrings, " stop strings"));
  }
  for (const auto& stop : s.stop()) {
    if (stop.empty() || stop.size() > kMaxStopStringBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("stop strings must be 1..", kMaxStopStringBytes, " bytes"));
    }
    absl::Status st = ValidateUtf8(stop, "stop string");
    if (!st.ok()) return st;
    out.stop.push_back(stop);
  }
  out.stop_token_ids.assign(s.stop_token_ids().begin(), s.stop_token_ids().end());
  out.ignore_eos = s.ignore_eos();
  out.pin = request.pin();
  if (request.has_tokens_read()) {
    if (request.tokens_read() < 0) {
      return absl::InvalidArgumentError(absl::StrCat("tokens_read ", request.tokens_read(), " is negative"));
    }
    if (out.mode == sched::RequestMode::kAppend) out.tokens_read = request.tokens_read();
  }
  if (request.continued_tokens() != 0) {
    if (request.continued_tokens() < 0 ||
        (!append && request.continued_tokens() > static_cast<int64_t>(out.input.size()))) {
      return absl::InvalidArgumentError(absl::StrCat("continued_tokens ", request.continued_tokens(),
                                                     " must be within the ", out.input.size(),
                                                     " input tokens of a FULL_CONTEXT request"));
    }
    out.continued = request.continued_tokens();
  }
  return out;
}

}  // namespace kvcache::service
