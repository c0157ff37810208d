// The wire rule for session ids (common.proto GenerateRequest.session_id), one
// definition for the worker's calls, the router's and the HTTP API's keys.
//
// Thread-safety: pure functions.
#ifndef KVCACHE_COMMON_SESSION_ID_H_
#define KVCACHE_COMMON_SESSION_ID_H_

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace kvcache {

inline constexpr int kMaxSessionIdBytes = 128;

// True when `id` is 1..kMaxSessionIdBytes bytes of [A-Za-z0-9._:-].
bool IsValidSessionId(absl::string_view id);

// OK for a valid id; INVALID_ARGUMENT saying which rule `id` breaks.
absl::Status ValidateSessionId(absl::string_view id);

}  // namespace kvcache

#endif  // KVCACHE_COMMON_SESSION_ID_H_
