#include "common/peer_auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "grpcpp/support/client_interceptor.h"

namespace kvcache {
namespace {

constexpr absl::string_view kProofContext = "kvcache-peer-v1";

// Adds the authorization header to every call of the channel it is built into.
class BearerInterceptor : public grpc::experimental::Interceptor {
 public:
  explicit BearerInterceptor(const std::string* header) : header_(header) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
      methods->GetSendInitialMetadata()->emplace("authorization", *header_);
    }
    methods->Proceed();
  }

 private:
  const std::string* header_;
};

class BearerInterceptorFactory : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit BearerInterceptorFactory(std::string header) : header_(std::move(header)) {}
  grpc::experimental::Interceptor* CreateClientInterceptor(grpc::experimental::ClientRpcInfo*) override {
    return new BearerInterceptor(&header_);
  }

 private:
  const std::string header_;
};

bool ConstantTimeEqual(absl::string_view a, absl::string_view b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

}  // namespace

absl::StatusOr<ClusterToken> ClusterToken::FromFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read cluster token file ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  auto token = FromString(ss.str());
  if (!token.ok()) {
    return absl::Status(token.status().code(), absl::StrCat(path, ": ", token.status().message()));
  }
  return token;
}

absl::StatusOr<ClusterToken> ClusterToken::FromString(absl::string_view text) {
  absl::string_view token = absl::StripAsciiWhitespace(text);
  if (token.size() < kMinBytes) {
    return absl::InvalidArgumentError(absl::StrCat("cluster token has ", token.size(),
                                                   " bytes; want at least ", kMinBytes,
                                                   " (e.g. `openssl rand -hex 32`)"));
  }
  for (char c : token) {
    if (c < 0x21 || c > 0x7e) {
      return absl::InvalidArgumentError("cluster token must be one word of printable ASCII");
    }
  }
  return ClusterToken(std::string(token));
}

std::optional<absl::string_view> AuthorizationMetadata(const grpc::ServerContextBase& context) {
  const auto& md = context.client_metadata();
  auto it = md.find("authorization");
  if (it == md.end()) return std::nullopt;
  return absl::string_view(it->second.data(), it->second.size());
}

std::optional<absl::string_view> BearerToken(std::optional<absl::string_view> authorization) {
  if (!authorization.has_value()) return std::nullopt;
  absl::string_view value = *authorization;
  // The scheme is case-insensitive (RFC 7235 section 2.1): "bearer x" is "Bearer x".
  constexpr absl::string_view kScheme = "bearer ";
  if (!absl::StartsWithIgnoreCase(value, kScheme)) return absl::string_view();
  value.remove_prefix(kScheme.size());
  return absl::StripAsciiWhitespace(value);
}

std::shared_ptr<grpc::Channel> NewBearerChannel(const std::string& target,
                                                const std::shared_ptr<grpc::ChannelCredentials>& creds,
                                                const std::string& token,
                                                const grpc::ChannelArguments& args) {
  std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(std::make_unique<BearerInterceptorFactory>(absl::StrCat("Bearer ", token)));
  return grpc::experimental::CreateCustomChannelWithInterceptors(target, creds, args,
                                                                 std::move(interceptors));
}

std::shared_ptr<grpc::Channel> ClusterToken::NewChannel(
    const std::string& target, const std::shared_ptr<grpc::ChannelCredentials>& creds,
    const grpc::ChannelArguments& args) const {
  if (empty()) return grpc::CreateCustomChannel(target, creds, args);
  return NewBearerChannel(target, creds, token_, args);
}

absl::Status ClusterToken::Verify(const grpc::ServerContextBase& context) const {
  if (empty()) return absl::OkStatus();
  const std::optional<absl::string_view> token = BearerToken(context);
  if (!token.has_value()) {
    return absl::UnauthenticatedError(
        "this worker takes calls from its fleet only: missing 'authorization: Bearer <cluster token>'");
  }
  if (!ConstantTimeEqual(*token, token_)) {
    return absl::UnauthenticatedError("this worker takes calls from its fleet only: wrong cluster token");
  }
  return absl::OkStatus();
}

std::string ClusterToken::Proof(absl::string_view nonce) const {
  const std::string message = absl::StrCat(kProofContext, nonce);
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  HMAC(EVP_sha256(), token_.data(), static_cast<int>(token_.size()),
       reinterpret_cast<const unsigned char*>(message.data()), message.size(), out, &len);
  return std::string(reinterpret_cast<const char*>(out), len);
}

bool ClusterToken::CheckProof(absl::string_view nonce, absl::string_view proof) const {
  return !empty() && ConstantTimeEqual(Proof(nonce), proof);
}

std::string RandomBytes(size_t n) {
  std::string out(n, '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(out.data()), static_cast<int>(n)) != 1) {
    // The generator failing is not recoverable: a predictable nonce would make
    // the handshake replayable.
    std::abort();
  }
  return out;
}

}  // namespace kvcache
