// Bearer-token authentication of clients: each token maps to a tenant, and
// optionally to admin rights (the KvCacheAdmin service).
//
// Tokens file: one "TOKEN TENANT [admin]" per line; '#' starts a comment.
// Admin calls always need an admin token. With anonymous callers allowed
// (--allow_unauthenticated, an explicit choice), a caller without an
// authorization header is tenant "default" and never admin; a header that is
// there must still carry a known token.
//
// Thread-safety: immutable after construction.
#ifndef KVCACHE_ROUTER_AUTH_H_
#define KVCACHE_ROUTER_AUTH_H_

#include <memory>
#include <optional>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/grpcpp.h"

namespace kvcache::router {

struct Principal {
  std::string tenant;
  bool admin = false;
};

class Authenticator {
 public:
  // No tokens: with `allow_anonymous` everyone is tenant "default" (not admin),
  // whatever token it sends; without it every call is UNAUTHENTICATED.
  explicit Authenticator(bool allow_anonymous = false) : allow_anonymous_(allow_anonymous) {}
  // INVALID_ARGUMENT for a malformed line (naming it), NOT_FOUND for a missing file.
  static absl::StatusOr<std::unique_ptr<Authenticator>> FromFile(const std::string& path,
                                                                 bool allow_anonymous = false);
  static absl::StatusOr<std::unique_ptr<Authenticator>> FromText(const std::string& text,
                                                                 bool allow_anonymous = false);

  // UNAUTHENTICATED with an unknown token, or without one unless anonymous
  // callers are allowed; PERMISSION_DENIED when `need_admin` and the caller is
  // anonymous or its token is not an admin's.
  absl::StatusOr<Principal> Authenticate(const grpc::ServerContextBase& context, bool need_admin) const;
  // The same for an `authorization` value (nullopt: none), e.g. an HTTP header.
  absl::StatusOr<Principal> Authenticate(std::optional<absl::string_view> authorization,
                                         bool need_admin) const;

  bool enabled() const { return !tokens_.empty(); }

 private:
  const bool allow_anonymous_;
  absl::flat_hash_map<std::string, Principal> tokens_;
};

}  // namespace kvcache::router

#endif  // KVCACHE_ROUTER_AUTH_H_
