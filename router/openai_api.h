// The OpenAI HTTP API as kvcache's wire messages: request bodies of
// /v1/chat/completions and /v1/completions to a GenerateRequest, and the
// Generate stream back to OpenAI's response objects, stream chunks and error
// objects. Pure translation (no I/O), so that unit tests and the fuzzer reach
// all of it; router/http_gateway.h does the serving.
//
// Fields (OpenAI reference; vLLM's extensions top_k and ignore_eos): model,
// messages (string or text-part content; role "developer" is "system"),
// prompt (a string, or token ids), max_completion_tokens / max_tokens,
// temperature (default 1, as OpenAI's), top_p, seed, stop (string or list),
// stream, stream_options.include_usage, user, prompt_cache_key. Unknown fields
// are ignored; known ones that kvcache cannot honour (n > 1, logprobs, echo,
// tools, penalties (vLLM's repetition_penalty and min_p too), logit_bias,
// suffix, a response_format other than text) are INVALID_ARGUMENT rather than
// silently dropped.
//
// Every request is FULL_CONTEXT (OpenAI clients resend the history); its
// session, the affinity key, is the x-session-id header, else
// prompt_cache_key, else user, else none (an ephemeral session placed by
// prefix alone).
//
// Thread-safety: free functions are pure; a StopTrimmer belongs to one stream.
#ifndef KVCACHE_ROUTER_OPENAI_API_H_
#define KVCACHE_ROUTER_OPENAI_API_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kvcache/v1/common.pb.h"

namespace kvcache::router::openai {

enum class Endpoint { kChatCompletions, kCompletions };

// A parsed request: the GenerateRequest plus what shapes the HTTP answer.
struct ParsedRequest {
  Endpoint endpoint = Endpoint::kChatCompletions;
  // As sent; empty when the body names no model.
  std::string model;
  bool stream = false;
  // stream_options.include_usage: a last chunk carries the usage.
  bool include_usage = false;
  // The stop strings (also in generate.sampling.stop): the reply is cut before
  // the first one, as OpenAI servers do (the worker's text includes it).
  std::vector<std::string> stop;
  v1::GenerateRequest generate;
  // The session comes from prompt_cache_key or user, which OpenAI's clients may
  // share between conversations running at once (not from x-session-id).
  bool session_from_key = false;
};

// Parses a request body. `session_header` is the x-session-id header (nullopt
// when absent; INVALID_ARGUMENT when it is not a valid session id, empty
// included), while
// prompt_cache_key and user, free text in OpenAI's API, become a session id by
// a hash when they are not one already (see SessionIdForKey). Errors are
// INVALID_ARGUMENT naming the field (ParamOf).
absl::StatusOr<ParsedRequest> ParseRequest(Endpoint endpoint, absl::string_view body,
                                           std::optional<absl::string_view> session_header);

// `key` when it is a valid session id (1..128 bytes of [A-Za-z0-9._:-]), else
// "k-" followed by 32 hex digits of its SHA-256: stable across router replicas.
std::string SessionIdForKey(absl::string_view key);

// The request field an INVALID_ARGUMENT from ParseRequest is about ("" when
// none): OpenAI's error.param.
std::string ParamOf(const absl::Status& status);

// HTTP status for a status code: 400 INVALID_ARGUMENT, FAILED_PRECONDITION and
// OUT_OF_RANGE; 401 UNAUTHENTICATED; 403 PERMISSION_DENIED; 404 NOT_FOUND; 409
// ABORTED (the session is busy with another request); 429 RESOURCE_EXHAUSTED;
// 499 CANCELLED; 503 UNAVAILABLE; 504 DEADLINE_EXCEEDED; 500 otherwise.
int HttpStatusFor(absl::StatusCode code);

// A worker's refusal of a context longer than it serves (its --max_context,
// the model's context length, or its tier 0).
bool IsContextTooLong(const absl::Status& status);

// OpenAI's error object: {"error": {"message", "type", "param", "code"}}.
// `code` defaults to "context_length_exceeded" for IsContextTooLong (the code
// OpenAI's clients and vLLM's use), else the lower-case name of the status code.
std::string ErrorJson(const absl::Status& status, absl::string_view code = "");

// "stop" for EOS, a stop token or a stop string; "length" for max_tokens or a
// full context.
const char* FinishReasonName(v1::FinishReason reason);

// The fields every response object and chunk of one request share.
struct ResponseMeta {
  Endpoint endpoint = Endpoint::kChatCompletions;
  std::string id;       // "chatcmpl-..." or "cmpl-..."
  int64_t created = 0;  // Unix seconds
  std::string model;
};

// A fresh id for `endpoint`: its prefix and 24 hex digits from `random`.
std::string NewResponseId(Endpoint endpoint, uint64_t random_hi, uint64_t random_lo);

// The non-streaming response: chat.completion or text_completion, with the
// usage of `final` and, beside OpenAI's fields, "kvcache": {worker_id,
// session_id, time_to_first_token_ms (the worker's), predicted_cached_tokens}.
std::string ResponseJson(const ResponseMeta& meta, absl::string_view text, v1::FinishReason finish,
                         const v1::GenerateResponse::Final& final);

// One streaming chunk (without the SSE framing). A chat stream's first chunk
// carries the assistant role (`with_role`); the last content chunk carries the
// finish reason (`finish`, else null). With include_usage, every chunk has
// "usage": null, and UsageChunkJson ends the stream.
std::string ChunkJson(const ResponseMeta& meta, absl::string_view text, bool with_role,
                      const v1::FinishReason* finish, bool include_usage);
std::string UsageChunkJson(const ResponseMeta& meta, const v1::GenerateResponse::Final& final);

// GET /v1/models and /v1/models/{id}.
std::string ModelsJson(const std::vector<std::string>& names, int64_t created);
std::string ModelJson(absl::string_view name, int64_t created);

// Holds back the end of a stream that may be the start of a stop string, and
// cuts the text before the first stop string, so that no client ever sees one.
class StopTrimmer {
 public:
  explicit StopTrimmer(std::vector<std::string> stops);

  // Adds the next text delta; returns what may be sent now.
  std::string Push(absl::string_view delta);
  // At the end of the stream: what was held back (nothing once a stop string
  // matched).
  std::string Flush();
  bool matched() const { return matched_; }

 private:
  std::vector<std::string> stops_;
  std::string held_;
  bool matched_ = false;
};

}  // namespace kvcache::router::openai

#endif  // KVCACHE_ROUTER_OPENAI_API_H_
