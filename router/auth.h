// Bearer-token authentication of clients: each token maps to a tenant, and
// optionally to admin rights (the KvCacheAdmin service).
//
// Tokens file: one "TOKEN TENANT [admin]" per line; '#' starts a comment.
// Without a tokens file every caller is tenant "default" with admin rights
// (for a trusted network or local use).
//
// Thread-safety: immutable after construction.
#ifndef KVCACHE_ROUTER_AUTH_H_
#define KVCACHE_ROUTER_AUTH_H_

#include <memory>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "grpcpp/grpcpp.h"

namespace kvcache::router {

struct Principal {
  std::string tenant;
  bool admin = false;
};

class Authenticator {
 public:
  // Everyone is tenant "default", admin.
  Authenticator() = default;
  // INVALID_ARGUMENT for a malformed line (naming it), NOT_FOUND for a missing file.
  static absl::StatusOr<std::unique_ptr<Authenticator>> FromFile(const std::string& path);
  static absl::StatusOr<std::unique_ptr<Authenticator>> FromText(const std::string& text);

  // UNAUTHENTICATED without a valid `authorization: Bearer <token>`;
  // PERMISSION_DENIED when `need_admin` and the token is not an admin's.
  absl::StatusOr<Principal> Authenticate(const grpc::ServerContextBase& context, bool need_admin) const;

  bool enabled() const { return !tokens_.empty(); }

 private:
  absl::flat_hash_map<std::string, Principal> tokens_;
};

}  // namespace kvcache::router

#endif  // KVCACHE_ROUTER_AUTH_H_
