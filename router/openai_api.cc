#include "router/openai_api.h"

#include <openssl/sha.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/cord.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/session_id.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"

namespace kvcache::router::openai {
namespace {

using Json = nlohmann::json;
using OJson = nlohmann::ordered_json;

// The status payload that carries the request field an error is about.
constexpr char kParamPayload[] = "type.kvcache.dev/openai.param";

absl::Status FieldError(absl::string_view field, absl::string_view message) {
  absl::Status st = absl::InvalidArgumentError(absl::StrCat("'", field, "' ", message));
  st.SetPayload(kParamPayload, absl::Cord(field));
  return st;
}

// The member `name` of `object`, or null when it is absent or JSON null (both
// mean "the default" in OpenAI's API).
const Json* Member(const Json& object, const char* name) {
  auto it = object.find(name);
  if (it == object.end() || it->is_null()) return nullptr;
  return &*it;
}

absl::StatusOr<int64_t> Integer(const Json& v, const char* field) {
  if (v.is_number_unsigned()) {
    if (v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      return FieldError(field, "is out of range");
    return static_cast<int64_t>(v.get<uint64_t>());
  }
  if (v.is_number_integer()) return v.get<int64_t>();
  if (v.is_number_float()) {
    // 16.0 is an integer to OpenAI's (lax) validation too.
    const double d = v.get<double>();
    if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9.0e18) return static_cast<int64_t>(d);
  }
  return FieldError(field, "must be an integer");
}

absl::StatusOr<double> Number(const Json& v, const char* field) {
  if (!v.is_number()) return FieldError(field, "must be a number");
  return v.get<double>();
}

absl::StatusOr<bool> Bool(const Json& v, const char* field) {
  if (!v.is_boolean()) return FieldError(field, "must be a boolean");
  return v.get<bool>();
}

absl::StatusOr<std::string> String(const Json& v, const char* field) {
  if (!v.is_string()) return FieldError(field, "must be a string");
  return v.get<std::string>();
}

// A message's content: a string, or a list of text parts (joined by newlines,
// as vLLM does). Required, as OpenAI requires it, but for an assistant's, which
// may be null (a reply replayed with its refusal, say): empty then. A missing
// one was an empty turn, so a client's misnamed field went unnoticed.
absl::StatusOr<std::string> MessageContent(const Json& message, const std::string& field, bool optional) {
  const Json* content = Member(message, "content");
  if (content == nullptr || content->is_null()) {
    if (optional) return std::string();
    return FieldError(field, "needs its 'content' (a string or a list of text parts)");
  }
  if (content->is_string()) return content->get<std::string>();
  if (!content->is_array()) return FieldError(field, "content must be a string or a list of text parts");
  std::vector<std::string> parts;
  for (const Json& part : *content) {
    if (!part.is_object()) return FieldError(field, "content parts must be objects");
    const Json* type = Member(part, "type");
    if (type == nullptr || !type->is_string() || type->get<std::string>() != "text") {
      return FieldError(field, "content parts must be of type 'text' (this model reads text only)");
    }
    const Json* text = Member(part, "text");
    if (text == nullptr || !text->is_string()) return FieldError(field, "a text part needs a string 'text'");
    parts.push_back(text->get<std::string>());
  }
  return absl::StrJoin(parts, "\n");
}

absl::Status ParseMessages(const Json& body, v1::ChatMessages* chat) {
  const Json* messages = Member(body, "messages");
  if (messages == nullptr) return FieldError("messages", "is required");
  if (!messages->is_array() || messages->empty()) return FieldError("messages", "must be a non-empty list");
  for (size_t i = 0; i < messages->size(); ++i) {
    const Json& m = (*messages)[i];
    const std::string field = absl::StrCat("messages[", i, "]");
    if (!m.is_object()) return FieldError(field, "must be an object");
    const Json* role = Member(m, "role");
    if (role == nullptr || !role->is_string()) return FieldError(field, "needs a string 'role'");
    std::string r = role->get<std::string>();
    if (r == "developer") r = "system";  // OpenAI's newer name for it
    if (r != "system" && r != "user" && r != "assistant") {
      return FieldError(field, absl::StrCat("has role '", r, "': want system, developer, user or assistant"));
    }
    if (const Json* calls = Member(m, "tool_calls"); calls != nullptr && !calls->empty()) {
      return FieldError(field, "has tool_calls: tools are not supported");
    }
    KVCACHE_ASSIGN_OR_RETURN(std::string content, MessageContent(m, field, /*optional=*/r == "assistant"));
    v1::ChatMessage* out = chat->add_messages();
    out->set_role(std::move(r));
    out->set_content(std::move(content));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int32_t>> TokenIds(const Json& list) {
  std::vector<int32_t> ids;
  ids.reserve(list.size());
  for (const Json& v : list) {
    if (!v.is_number_integer()) return FieldError("prompt", "must be a string or a list of token ids");
    KVCACHE_ASSIGN_OR_RETURN(int64_t id, Integer(v, "prompt"));
    if (id < 0 || id > std::numeric_limits<int32_t>::max()) return FieldError("prompt", "has a bad token id");
    ids.push_back(static_cast<int32_t>(id));
  }
  return ids;
}

// prompt: a string, a list of one string, token ids, or a list of one list of
// token ids. Several prompts in one request (a batch) are not supported.
absl::Status ParsePrompt(const Json& body, v1::Input* input) {
  const Json* prompt = Member(body, "prompt");
  if (prompt == nullptr) return FieldError("prompt", "is required");
  if (prompt->is_string()) {
    input->set_text(prompt->get<std::string>());
    return absl::OkStatus();
  }
  if (!prompt->is_array() || prompt->empty()) {
    return FieldError("prompt", "must be a string, a list of token ids, or a non-empty list of them");
  }
  const Json& first = prompt->front();
  if (first.is_number()) {
    KVCACHE_ASSIGN_OR_RETURN(std::vector<int32_t> ids, TokenIds(*prompt));
    input->mutable_tokens()->mutable_ids()->Assign(ids.begin(), ids.end());
    return absl::OkStatus();
  }
  if (prompt->size() != 1) return FieldError("prompt", "holds several prompts: send one per request");
  if (first.is_string()) {
    input->set_text(first.get<std::string>());
    return absl::OkStatus();
  }
  if (first.is_array()) {
    KVCACHE_ASSIGN_OR_RETURN(std::vector<int32_t> ids, TokenIds(first));
    input->mutable_tokens()->mutable_ids()->Assign(ids.begin(), ids.end());
    return absl::OkStatus();
  }
  return FieldError("prompt", "must be a string or a list of token ids");
}

absl::StatusOr<std::vector<std::string>> ParseStop(const Json& body) {
  const Json* stop = Member(body, "stop");
  std::vector<std::string> stops;
  if (stop == nullptr) return stops;
  if (stop->is_string()) {
    stops.push_back(stop->get<std::string>());
  } else if (stop->is_array()) {
    for (const Json& s : *stop) {
      if (!s.is_string()) return FieldError("stop", "must be a string or a list of strings");
      stops.push_back(s.get<std::string>());
    }
  } else {
    return FieldError("stop", "must be a string or a list of strings");
  }
  for (const auto& s : stops) {
    if (s.empty()) return FieldError("stop", "must not hold an empty string");
  }
  return stops;
}

// Fields of OpenAI's API that kvcache cannot honour: refused when they ask for
// anything but the default, so that a client never gets silently different
// behaviour.
absl::Status RefuseUnsupported(const Json& body) {
  for (const char* field : {"n", "best_of"}) {
    if (const Json* v = Member(body, field)) {
      KVCACHE_ASSIGN_OR_RETURN(int64_t n, Integer(*v, field));
      if (n != 1) return FieldError(field, "must be 1: one choice per request");
    }
  }
  for (const char* field : {"frequency_penalty", "presence_penalty"}) {
    if (const Json* v = Member(body, field)) {
      KVCACHE_ASSIGN_OR_RETURN(double p, Number(*v, field));
      if (p != 0) return FieldError(field, "is not supported (only 0)");
    }
  }
  // vLLM's sampling extras besides top_k: accepted only at their no-op values.
  if (const Json* v = Member(body, "repetition_penalty")) {
    KVCACHE_ASSIGN_OR_RETURN(double p, Number(*v, "repetition_penalty"));
    if (p != 1) return FieldError("repetition_penalty", "is not supported (only 1)");
  }
  if (const Json* v = Member(body, "min_p")) {
    KVCACHE_ASSIGN_OR_RETURN(double p, Number(*v, "min_p"));
    if (p != 0) return FieldError("min_p", "is not supported (only 0)");
  }
  // Chat's logprobs is a boolean; the legacy completions API's is a count of
  // alternatives, and any count (0 too) asks for the sampled tokens' log
  // probabilities. top_logprobs = 0 asks for nothing.
  if (const Json* v = Member(body, "logprobs"); v != nullptr && !(v->is_boolean() && !v->get<bool>())) {
    return FieldError("logprobs", "is not supported");
  }
  if (const Json* v = Member(body, "top_logprobs");
      v != nullptr && !(v->is_number() && v->get<double>() == 0)) {
    return FieldError("top_logprobs", "is not supported");
  }
  if (const Json* v = Member(body, "echo"); v != nullptr && !(v->is_boolean() && !v->get<bool>())) {
    return FieldError("echo", "is not supported");
  }
  for (const char* field : {"tools", "functions", "logit_bias"}) {
    if (const Json* v = Member(body, field); v != nullptr && !(v->is_structured() && v->empty())) {
      return FieldError(field, "is not supported");
    }
  }
  // Without tools there is no call to force: only the values that ask for none.
  for (const char* field : {"tool_choice", "function_call"}) {
    if (const Json* v = Member(body, field);
        v != nullptr &&
        !(v->is_string() && (v->get<std::string>() == "none" || v->get<std::string>() == "auto"))) {
      return FieldError(field, "is not supported (there are no tools: only \"none\" or \"auto\")");
    }
  }
  if (const Json* v = Member(body, "suffix"); v != nullptr && !(v->is_string() && v->empty())) {
    return FieldError("suffix", "is not supported");
  }
  if (const Json* v = Member(body, "response_format")) {
    const Json* type = v->is_object() ? Member(*v, "type") : nullptr;
    if (type == nullptr || !type->is_string() || type->get<std::string>() != "text") {
      return FieldError("response_format", "is not supported (only {\"type\": \"text\"})");
    }
  }
  return absl::OkStatus();
}

absl::Status ParseSampling(const Json& body, v1::SamplingParams* s) {
  // OpenAI's default temperature is 1 (kvcache's gRPC default is greedy).
  double temperature = 1.0;
  if (const Json* v = Member(body, "temperature")) {
    KVCACHE_ASSIGN_OR_RETURN(temperature, Number(*v, "temperature"));
    if (!(temperature >= 0 && temperature <= 2)) return FieldError("temperature", "must be in [0, 2]");
  }
  s->set_temperature(static_cast<float>(temperature));
  if (const Json* v = Member(body, "top_p")) {
    KVCACHE_ASSIGN_OR_RETURN(double top_p, Number(*v, "top_p"));
    if (!(top_p >= 0 && top_p <= 1)) return FieldError("top_p", "must be in [0, 1]");
    // OpenAI's 0 keeps the most likely token alone, as does the smallest
    // positive float (the wire's 0 means no cut, and so would a value that
    // rounds to it).
    s->set_top_p(std::max(static_cast<float>(top_p), std::numeric_limits<float>::min()));
  }
  if (const Json* v = Member(body, "top_k")) {  // vLLM's extension; -1 and 0 disable it
    KVCACHE_ASSIGN_OR_RETURN(int64_t top_k, Integer(*v, "top_k"));
    if (top_k < -1 || top_k > std::numeric_limits<int32_t>::max())
      return FieldError("top_k", "is out of range");
    s->set_top_k(static_cast<int32_t>(std::max<int64_t>(0, top_k)));
  }
  if (const Json* v = Member(body, "seed")) {
    uint64_t seed = 0;
    if (v->is_number_unsigned()) {
      seed = v->get<uint64_t>();
    } else {
      KVCACHE_ASSIGN_OR_RETURN(int64_t signed_seed, Integer(*v, "seed"));
      seed = static_cast<uint64_t>(signed_seed);
    }
    // The wire's 0 means "derived from the session"; an explicit seed 0 must
    // give the same text on every session too.
    s->set_seed(seed == 0 ? 0x9e3779b97f4a7c15ull : seed);
  }
  // max_completion_tokens replaced max_tokens in OpenAI's chat API; either is taken.
  for (const char* field : {"max_tokens", "max_completion_tokens"}) {
    if (const Json* v = Member(body, field)) {
      KVCACHE_ASSIGN_OR_RETURN(int64_t max_tokens, Integer(*v, field));
      if (max_tokens < 1) return FieldError(field, "must be at least 1");
      if (max_tokens > std::numeric_limits<int32_t>::max())
        return FieldError(field, absl::StrCat("must be at most ", std::numeric_limits<int32_t>::max()));
      s->set_max_tokens(static_cast<int32_t>(max_tokens));
    }
  }
  if (const Json* v = Member(body, "ignore_eos")) {  // vLLM's extension (benchmarks)
    KVCACHE_ASSIGN_OR_RETURN(bool ignore, Bool(*v, "ignore_eos"));
    s->set_ignore_eos(ignore);
  }
  return absl::OkStatus();
}

const char* ErrorType(int http_status) {
  switch (http_status) {
    case 400:
      return "invalid_request_error";
    case 401:
      return "authentication_error";
    case 403:
      return "permission_error";
    case 404:
      return "not_found_error";
    case 409:
      return "conflict_error";
    case 429:
      return "rate_limit_error";
    case 499:
      return "cancelled_error";
    case 503:
      return "service_unavailable_error";
    case 504:
      return "timeout_error";
    default:
      return "internal_error";
  }
}

std::string Dump(const OJson& j) { return j.dump(-1, ' ', false, OJson::error_handler_t::replace); }

OJson UsageObject(const v1::Usage& usage) {
  OJson u;
  u["prompt_tokens"] = usage.prompt_tokens();
  u["completion_tokens"] = usage.generated_tokens();
  u["total_tokens"] = static_cast<int64_t>(usage.prompt_tokens()) + usage.generated_tokens();
  u["prompt_tokens_details"] = OJson{{"cached_tokens", usage.cached_tokens()}};
  return u;
}

OJson KvcacheObject(const v1::GenerateResponse::Final& final) {
  OJson k;
  k["worker_id"] = final.worker_id();
  k["session_id"] = final.session_id();
  k["time_to_first_token_ms"] = final.usage().time_to_first_token_us() / 1e3;
  k["predicted_cached_tokens"] = final.predicted_cached_tokens();
  return k;
}

OJson Envelope(const ResponseMeta& meta, const char* chat_object, const char* completion_object) {
  OJson j;
  j["id"] = meta.id;
  j["object"] = meta.endpoint == Endpoint::kChatCompletions ? chat_object : completion_object;
  j["created"] = meta.created;
  j["model"] = meta.model;
  return j;
}

}  // namespace

std::string SessionIdForKey(absl::string_view key) {
  if (IsValidSessionId(key)) return std::string(key);
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(key.data()), key.size(), digest);
  return absl::StrCat("k-", absl::BytesToHexString(absl::string_view(reinterpret_cast<char*>(digest), 16)));
}

absl::StatusOr<ParsedRequest> ParseRequest(Endpoint endpoint, absl::string_view body,
                                           std::optional<absl::string_view> session_header) {
  const Json j = Json::parse(body.data(), body.data() + body.size(), /*cb=*/nullptr,
                             /*allow_exceptions=*/false);
  if (j.is_discarded()) return absl::InvalidArgumentError("the request body is not valid JSON");
  if (!j.is_object()) return absl::InvalidArgumentError("the request body must be a JSON object");
  ParsedRequest r;
  r.endpoint = endpoint;
  if (const Json* v = Member(j, "model")) {
    KVCACHE_ASSIGN_OR_RETURN(r.model, String(*v, "model"));
  }
  if (const Json* v = Member(j, "stream")) {
    KVCACHE_ASSIGN_OR_RETURN(r.stream, Bool(*v, "stream"));
  }
  if (const Json* v = Member(j, "stream_options")) {
    if (!v->is_object()) return FieldError("stream_options", "must be an object");
    if (const Json* u = Member(*v, "include_usage")) {
      KVCACHE_ASSIGN_OR_RETURN(r.include_usage, Bool(*u, "stream_options.include_usage"));
    }
  }
  KVCACHE_RETURN_IF_ERROR(RefuseUnsupported(j));

  v1::GenerateRequest& g = r.generate;
  g.set_mode(v1::FULL_CONTEXT);
  if (endpoint == Endpoint::kChatCompletions) {
    KVCACHE_RETURN_IF_ERROR(ParseMessages(j, g.mutable_input()->mutable_chat()));
  } else {
    KVCACHE_RETURN_IF_ERROR(ParsePrompt(j, g.mutable_input()));
  }
  KVCACHE_RETURN_IF_ERROR(ParseSampling(j, g.mutable_sampling()));
  KVCACHE_ASSIGN_OR_RETURN(r.stop, ParseStop(j));
  for (const auto& s : r.stop) g.mutable_sampling()->add_stop(s);

  std::string key;
  for (const char* field : {"user", "prompt_cache_key"}) {  // the later one wins
    if (const Json* v = Member(j, field)) {
      KVCACHE_ASSIGN_OR_RETURN(std::string value, String(*v, field));
      if (!value.empty()) key = std::move(value);
    }
  }
  if (session_header.has_value()) {
    // Checked here: a byte that is not UTF-8 would not even reach the router's
    // own check (protobuf refuses to send it), and the client would get a 500.
    if (absl::Status st = ValidateSessionId(*session_header); !st.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("x-session-id: ", st.message()));
    }
    g.set_session_id(std::string(*session_header));
  } else if (!key.empty()) {
    g.set_session_id(SessionIdForKey(key));
    r.session_from_key = true;
  }
  return r;
}

std::string ParamOf(const absl::Status& status) {
  const auto param = status.GetPayload(kParamPayload);
  return param.has_value() ? std::string(*param) : std::string();
}

int HttpStatusFor(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kOk:
      return 200;
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kOutOfRange:
      return 400;
    case absl::StatusCode::kUnauthenticated:
      return 401;
    case absl::StatusCode::kPermissionDenied:
      return 403;
    case absl::StatusCode::kNotFound:
      return 404;
    case absl::StatusCode::kAborted:
      return 409;
    case absl::StatusCode::kResourceExhausted:
      return 429;
    case absl::StatusCode::kCancelled:
      return 499;
    case absl::StatusCode::kUnavailable:
      return 503;
    case absl::StatusCode::kDeadlineExceeded:
      return 504;
    default:
      return 500;
  }
}

bool IsContextTooLong(const absl::Status& status) {
  // What a worker answers a context over its --max_context, the model's
  // context or its tier 0 (worker.proto), and a router when every worker did.
  return status.code() == absl::StatusCode::kOutOfRange;
}

std::string ErrorJson(const absl::Status& status, absl::string_view code) {
  const std::string param = ParamOf(status);
  OJson e;
  e["message"] = std::string(status.message());
  e["type"] = ErrorType(HttpStatusFor(status.code()));
  e["param"] = param.empty() ? OJson(nullptr) : OJson(param);
  if (code.empty() && IsContextTooLong(status)) code = "context_length_exceeded";  // what clients look for
  e["code"] =
      code.empty() ? absl::AsciiStrToLower(absl::StatusCodeToString(status.code())) : std::string(code);
  return Dump(OJson{{"error", std::move(e)}});
}

const char* FinishReasonName(v1::FinishReason reason) {
  switch (reason) {
    case v1::FINISH_REASON_LENGTH:
    case v1::FINISH_REASON_CONTEXT_FULL:
      return "length";
    default:
      return "stop";
  }
}

std::string NewResponseId(Endpoint endpoint, uint64_t random_hi, uint64_t random_lo) {
  return absl::StrFormat("%s%08x%016x", endpoint == Endpoint::kChatCompletions ? "chatcmpl-" : "cmpl-",
                         random_hi & 0xffffffffu, random_lo);
}

std::string ResponseJson(const ResponseMeta& meta, absl::string_view text, v1::FinishReason finish,
                         const v1::GenerateResponse::Final& final) {
  OJson j = Envelope(meta, "chat.completion", "text_completion");
  OJson choice;
  choice["index"] = 0;
  if (meta.endpoint == Endpoint::kChatCompletions) {
    choice["message"] = OJson{{"role", "assistant"}, {"content", std::string(text)}};
  } else {
    choice["text"] = std::string(text);
  }
  choice["logprobs"] = nullptr;
  choice["finish_reason"] = FinishReasonName(finish);
  j["choices"] = OJson::array({std::move(choice)});
  j["usage"] = UsageObject(final.usage());
  j["kvcache"] = KvcacheObject(final);
  return Dump(j);
}

std::string ChunkJson(const ResponseMeta& meta, absl::string_view text, bool with_role,
                      const v1::FinishReason* finish, bool include_usage) {
  OJson j = Envelope(meta, "chat.completion.chunk", "text_completion");
  OJson choice;
  choice["index"] = 0;
  if (meta.endpoint == Endpoint::kChatCompletions) {
    OJson delta = OJson::object();
    if (with_role) delta["role"] = "assistant";
    if (with_role || !text.empty()) delta["content"] = std::string(text);
    choice["delta"] = std::move(delta);
  } else {
    choice["text"] = std::string(text);
  }
  choice["logprobs"] = nullptr;
  choice["finish_reason"] = finish == nullptr ? OJson(nullptr) : OJson(FinishReasonName(*finish));
  j["choices"] = OJson::array({std::move(choice)});
  if (include_usage) j["usage"] = nullptr;
  return Dump(j);
}

std::string UsageChunkJson(const ResponseMeta& meta, const v1::GenerateResponse::Final& final) {
  OJson j = Envelope(meta, "chat.completion.chunk", "text_completion");
  j["choices"] = OJson::array();
  j["usage"] = UsageObject(final.usage());
  j["kvcache"] = KvcacheObject(final);
  return Dump(j);
}

std::string ModelJson(absl::string_view name, int64_t created) {
  return Dump(
      OJson{{"id", std::string(name)}, {"object", "model"}, {"created", created}, {"owned_by", "kvcache"}});
}

std::string ModelsJson(const std::vector<std::string>& names, int64_t created) {
  OJson data = OJson::array();
  for (const auto& n : names) {
    data.push_back(OJson{{"id", n}, {"object", "model"}, {"created", created}, {"owned_by", "kvcache"}});
  }
  return Dump(OJson{{"object", "list"}, {"data", std::move(data)}});
}

StopTrimmer::StopTrimmer(std::vector<std::string> stops) : stops_(std::move(stops)) {
  stops_.erase(std::remove(stops_.begin(), stops_.end(), std::string()), stops_.end());
}

std::string StopTrimmer::Push(absl::string_view delta) {
  if (matched_) return std::string();
  held_.append(delta.data(), delta.size());
  if (stops_.empty()) return std::exchange(held_, std::string());
  size_t cut = std::string::npos;
  for (const auto& s : stops_) cut = std::min(cut, held_.find(s));
  if (cut != std::string::npos) {
    matched_ = true;
    std::string out = held_.substr(0, cut);
    held_.clear();
    return out;
  }
  // Hold back the longest tail that a later delta could complete into a stop
  // string. It starts where a stop string starts, so never inside a UTF-8
  // character.
  size_t keep = 0;
  for (const auto& s : stops_) {
    for (size_t len = std::min(s.size() - 1, held_.size()); len > keep; --len) {
      if (held_.compare(held_.size() - len, len, s, 0, len) == 0) {
        keep = len;
        break;
      }
    }
  }
  std::string out = held_.substr(0, held_.size() - keep);
  held_.erase(0, held_.size() - keep);
  return out;
}

std::string StopTrimmer::Flush() {
  if (matched_) return std::string();
  return std::exchange(held_, std::string());
}

}  // namespace kvcache::router::openai
