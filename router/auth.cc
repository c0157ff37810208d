#include "router/auth.h"

#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/peer_auth.h"

namespace kvcache::router {

absl::StatusOr<std::unique_ptr<Authenticator>> Authenticator::FromFile(const std::string& path,
                                                                       bool allow_anonymous) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read tokens file ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return FromText(ss.str(), allow_anonymous);
}

absl::StatusOr<std::unique_ptr<Authenticator>> Authenticator::FromText(const std::string& text,
                                                                       bool allow_anonymous) {
  auto a = std::make_unique<Authenticator>(allow_anonymous);
  int line_no = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_no;
    line = absl::StripAsciiWhitespace(line.substr(0, line.find('#')));
    if (line.empty()) continue;
    std::vector<std::string> f = absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    if (f.size() < 2 || f.size() > 3 || (f.size() == 3 && f[2] != "admin")) {
      return absl::InvalidArgumentError(
          absl::StrCat("tokens file line ", line_no, ": want TOKEN TENANT [admin]"));
    }
    if (a->tokens_.contains(f[0])) {
      return absl::InvalidArgumentError(absl::StrCat("tokens file line ", line_no, ": duplicate token"));
    }
    a->tokens_[f[0]] = Principal{f[1], f.size() == 3};
  }
  if (a->tokens_.empty()) return absl::InvalidArgumentError("tokens file has no tokens");
  return a;
}

absl::StatusOr<Principal> Authenticator::Authenticate(const grpc::ServerContextBase& context,
                                                      bool need_admin) const {
  return Authenticate(AuthorizationMetadata(context), need_admin);
}

absl::StatusOr<Principal> Authenticator::Authenticate(std::optional<absl::string_view> authorization,
                                                      bool need_admin) const {
  const std::optional<absl::string_view> token = BearerToken(authorization);
  // Without a tokens file every caller is anonymous, whatever it sends: SDKs
  // (OpenAI's among them) always send some key.
  if (!token.has_value() || (tokens_.empty() && allow_anonymous_)) {
    if (!allow_anonymous_)
      return absl::UnauthenticatedError("missing 'authorization: Bearer <token>' metadata");
    if (need_admin) {
      return absl::PermissionDeniedError(
          "admin calls need an admin token ('authorization: Bearer <token>' of a tokens-file line "
          "'TOKEN TENANT admin')");
    }
    return Principal{"default", false};
  }
  if (token->empty()) return absl::UnauthenticatedError("authorization metadata must be 'Bearer <token>'");
  auto p = tokens_.find(*token);
  if (p == tokens_.end()) return absl::UnauthenticatedError("unknown bearer token");
  if (need_admin && !p->second.admin) return absl::PermissionDeniedError("admin calls need an admin token");
  return p->second;
}

}  // namespace kvcache::router
