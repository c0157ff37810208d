// Authentication between the servers of one fleet (router -> worker, worker ->
// worker).
//
// A worker takes internal calls only from authenticated peers: the caller
// either presents the shared cluster token (--cluster_token_file, e.g. a
// Kubernetes Secret) as `authorization: Bearer <token>`, or holds a client
// certificate the worker verified in the TLS handshake (--tls_client_ca). A
// worker with neither refuses to start unless --allow_unauthenticated says so.
//
// A token is a bearer secret: over plaintext gRPC it protects against callers
// that do not hold it, not against a listener on the network. Use TLS for that
// (deploy/k8s/components/tls); the two combine.
//
// Migration checks the target too (see PeerHandshake in worker.proto): with a
// token the target must answer HMAC-SHA256(token, "kvcache-peer-v1" || nonce);
// with TLS the channel has verified the target's certificate.
//
//   auto token = ClusterToken::FromFile(path);
//   auto channel = token->NewChannel(address, creds);   // every call carries it
//   absl::Status st = token->Verify(*server_context);    // UNAUTHENTICATED unless it does
//
// Thread-safety: immutable after construction.
#ifndef KVCACHE_COMMON_PEER_AUTH_H_
#define KVCACHE_COMMON_PEER_AUTH_H_

#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/grpcpp.h"

namespace kvcache {

class ClusterToken {
 public:
  // No token: channels carry nothing, Verify accepts every caller.
  ClusterToken() = default;
  // The file's content without surrounding whitespace. NOT_FOUND when it cannot
  // be read; INVALID_ARGUMENT when shorter than kMinBytes or not one line of
  // printable ASCII (it travels in an HTTP/2 header).
  static absl::StatusOr<ClusterToken> FromFile(const std::string& path);
  static absl::StatusOr<ClusterToken> FromString(absl::string_view token);
  static constexpr size_t kMinBytes = 16;

  bool empty() const { return token_.empty(); }

  // A channel whose every call carries `authorization: Bearer <token>` (a plain
  // channel when empty).
  std::shared_ptr<grpc::Channel> NewChannel(const std::string& target,
                                            const std::shared_ptr<grpc::ChannelCredentials>& creds,
                                            const grpc::ChannelArguments& args = {}) const;

  // OK when empty or when the call carries this token (compared in constant
  // time); UNAUTHENTICATED otherwise, without saying what was expected.
  absl::Status Verify(const grpc::ServerContextBase& context) const;

  // HMAC-SHA256(token, "kvcache-peer-v1" || nonce). REQUIRES: !empty().
  std::string Proof(absl::string_view nonce) const;
  bool CheckProof(absl::string_view nonce, absl::string_view proof) const;

 private:
  explicit ClusterToken(std::string token) : token_(std::move(token)) {}
  std::string token_;
};

// A call's `authorization` metadata, or nullopt.
std::optional<absl::string_view> AuthorizationMetadata(const grpc::ServerContextBase& context);
// The token of an `authorization: Bearer <token>` value (a call's metadata, or
// the HTTP API's header): nullopt when there is none, an empty view when it is
// not a bearer token. The one parser of that header (routers' clients, workers'
// peers).
std::optional<absl::string_view> BearerToken(std::optional<absl::string_view> authorization);
inline std::optional<absl::string_view> BearerToken(const grpc::ServerContextBase& context) {
  return BearerToken(AuthorizationMetadata(context));
}

// A channel whose every call carries `authorization: Bearer <token>`: the one
// way kvcache's own clients attach a token (cluster or client).
std::shared_ptr<grpc::Channel> NewBearerChannel(const std::string& target,
                                                const std::shared_ptr<grpc::ChannelCredentials>& creds,
                                                const std::string& token,
                                                const grpc::ChannelArguments& args = {});

// Random bytes from the operating system's generator (OpenSSL RAND_bytes).
std::string RandomBytes(size_t n);

}  // namespace kvcache

#endif  // KVCACHE_COMMON_PEER_AUTH_H_
