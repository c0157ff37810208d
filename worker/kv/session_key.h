// Session keys: sessions are named by (tenant, session id) everywhere in the
// worker, so the same id in two tenants names two independent sessions and no
// answer tells one tenant about another's ids.
//
// The KV cache and the engine key their tables by one string that encodes the
// pair unambiguously ("<tenant length>:<tenant><id>"); only this header builds or
// reads it. Keys of ephemeral (unnamed) sessions start with '~' and never parse
// as a pair: they are not routable and never leave the worker.
//
// Thread-safety: pure functions.
#ifndef KVCACHE_WORKER_KV_SESSION_KEY_H_
#define KVCACHE_WORKER_KV_SESSION_KEY_H_

#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace kvcache::kv {

struct SessionName {
  std::string tenant;
  std::string id;  // empty for ephemeral keys
};

inline std::string SessionKey(absl::string_view tenant, absl::string_view id) {
  return absl::StrCat(tenant.size(), ":", tenant, id);
}

inline bool IsEphemeralKey(absl::string_view key) { return !key.empty() && key[0] == '~'; }

// The pair a key names; {"", ""} for ephemeral or malformed keys.
inline SessionName SplitSessionKey(absl::string_view key) {
  const size_t colon = key.find(':');
  size_t n = 0;
  if (IsEphemeralKey(key) || colon == absl::string_view::npos ||
      !absl::SimpleAtoi(key.substr(0, colon), &n) || colon + 1 + n > key.size()) {
    return {};
  }
  return SessionName{std::string(key.substr(colon + 1, n)), std::string(key.substr(colon + 1 + n))};
}

// "session 'ID'" for messages: names the id a caller knows, never the key.
inline std::string QuoteSession(absl::string_view key) {
  const SessionName name = SplitSessionKey(key);
  return absl::StrCat("session '", name.id.empty() ? key : absl::string_view(name.id), "'");
}

}  // namespace kvcache::kv

#endif  // KVCACHE_WORKER_KV_SESSION_KEY_H_
