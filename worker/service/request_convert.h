// Validation and conversion of wire requests (kvcache.v1.GenerateRequest) into
// engine requests: the one place where the worker's input rules live.
//
// Thread-safety: pure functions over immutable inputs.
#ifndef KVCACHE_WORKER_SERVICE_REQUEST_CONVERT_H_
#define KVCACHE_WORKER_SERVICE_REQUEST_CONVERT_H_

#include <string>

#include "absl/status/statusor.h"
#include "common/session_id.h"
#include "common/tokenizer/chat_template.h"
#include "common/tokenizer/tokenizer.h"
#include "kvcache/v1/common.pb.h"
#include "worker/sched/engine.h"

namespace kvcache::service {

// Tenant used when a request carries none (no router, no auth).
inline constexpr char kDefaultTenant[] = "default";

inline constexpr int kMaxStopStrings = 16;
inline constexpr int kMaxStopStringBytes = 256;
inline constexpr size_t kMaxRequestIdBytes = 64;  // GenerateRequest.request_id

// The engine request for `request`: tokenised input (text with special tokens
// recognised; chat rendered with `chat_template`, which may be null when the
// model has none), sampling and limits. APPEND input is tokenised without BOS,
// and APPEND chat messages are rendered in the model's template as the
// continuation after the previous turn's end-of-turn token
// (ChatTemplate::RenderAppend; for ChatML: no default system prompt, a newline
// after the previous turn).
absl::StatusOr<sched::GenerateRequest> ToEngineRequest(const v1::GenerateRequest& request,
                                                       const tok::Tokenizer& tokenizer,
                                                       const tok::ChatTemplate* chat_template);

// The tenant a request acts for.
inline std::string TenantOf(const std::string& tenant) { return tenant.empty() ? kDefaultTenant : tenant; }

v1::FinishReason ToProto(sched::FinishReason reason);

}  // namespace kvcache::service

#endif  // KVCACHE_WORKER_SERVICE_REQUEST_CONVERT_H_
