#include "router/dns_resolver.h"

#include <arpa/inet.h>
#include <arpa/nameser.h>
#include <netdb.h>
#include <netinet/in.h>
#include <resolv.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace kvcache::router {
namespace {

std::string Join(const std::string& ip, bool v6, const std::string& port) {
  return v6 ? absl::StrCat("[", ip, "]:", port) : absl::StrCat(ip, ":", port);
}

DnsAnswer Finish(std::vector<std::string> addresses) {
  std::sort(addresses.begin(), addresses.end());
  addresses.erase(std::unique(addresses.begin(), addresses.end()), addresses.end());
  DnsAnswer a;
  a.result = addresses.empty() ? DnsAnswer::Result::kEmpty : DnsAnswer::Result::kOk;
  a.addresses = std::move(addresses);
  return a;
}

DnsAnswer Failed(std::string why) {
  DnsAnswer a;
  a.result = DnsAnswer::Result::kFailed;
  a.error = std::move(why);
  return a;
}

DnsAnswer ResolveSystem(const DnsTarget& t) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const int rc = getaddrinfo(t.name.c_str(), t.port.c_str(), &hints, &res);
  // A name that does not exist, or has no address of these families, is an
  // empty answer; anything else (no server reached, SERVFAIL) a failure.
  if (rc == EAI_NONAME || rc == EAI_NODATA) return Finish({});
  if (rc != 0) return Failed(gai_strerror(rc));
  std::vector<std::string> out;
  for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
    char buf[NI_MAXHOST];
    if (getnameinfo(a->ai_addr, a->ai_addrlen, buf, sizeof(buf), nullptr, 0, NI_NUMERICHOST) == 0) {
      out.push_back(Join(buf, a->ai_family == AF_INET6, t.port));
    }
  }
  freeaddrinfo(res);
  return Finish(std::move(out));
}

// One query of `type` to the server in `state`. Appends addresses; false with
// `error` set when the server could not answer (NXDOMAIN and NODATA are answers).
bool Query(res_state state, const DnsTarget& t, int type, std::vector<std::string>* out, std::string* error) {
  unsigned char buf[4096];
  const int n = res_nquery(state, t.name.c_str(), ns_c_in, type, buf, sizeof(buf));
  if (n < 0) {
    if (h_errno == HOST_NOT_FOUND || h_errno == NO_DATA) return true;
    *error = absl::StrCat("query to ", t.server, " failed: ", hstrerror(h_errno));
    return false;
  }
  ns_msg msg;
  if (ns_initparse(buf, n, &msg) != 0) {
    *error = absl::StrCat("malformed answer from ", t.server);
    return false;
  }
  for (int i = 0; i < ns_msg_count(msg, ns_s_an); ++i) {
    ns_rr rr;
    if (ns_parserr(&msg, ns_s_an, i, &rr) != 0) continue;
    char ip[INET6_ADDRSTRLEN];
    if (ns_rr_type(rr) == ns_t_a && ns_rr_rdlen(rr) == 4) {
      inet_ntop(AF_INET, ns_rr_rdata(rr), ip, sizeof(ip));
      out->push_back(Join(ip, false, t.port));
    } else if (ns_rr_type(rr) == ns_t_aaaa && ns_rr_rdlen(rr) == 16) {
      inet_ntop(AF_INET6, ns_rr_rdata(rr), ip, sizeof(ip));
      out->push_back(Join(ip, true, t.port));
    }
  }
  return true;
}

DnsAnswer ResolveAt(const DnsTarget& t, absl::Duration timeout) {
  const auto colon = t.server.rfind(':');
  int port = 0;
  in_addr server{};
  if (colon == std::string::npos || !absl::SimpleAtoi(t.server.substr(colon + 1), &port) ||
      inet_pton(AF_INET, t.server.substr(0, colon).c_str(), &server) != 1) {
    return Failed(absl::StrCat("DNS server '", t.server, "' must be IPv4:port"));
  }
  struct __res_state state;
  std::memset(&state, 0, sizeof(state));
  if (res_ninit(&state) != 0) return Failed("res_ninit failed");
  // Only the named server: drop what resolv.conf listed (IPv6 servers live in
  // _u._ext.nsaddrs, which glibc prefers when set).
  for (int i = 0; i < MAXNS; ++i) {
    std::free(state._u._ext.nsaddrs[i]);
    state._u._ext.nsaddrs[i] = nullptr;
  }
  state.nscount = 1;
  state.nsaddr_list[0].sin_family = AF_INET;
  state.nsaddr_list[0].sin_addr = server;
  state.nsaddr_list[0].sin_port = htons(static_cast<uint16_t>(port));
  state.retrans = std::max(1, static_cast<int>(absl::ToInt64Seconds(timeout)));
  state.retry = 1;
  state.options &= ~(RES_DNSRCH | RES_DEFNAMES);
  std::vector<std::string> out;
  std::string error;
  const bool ok = Query(&state, t, ns_t_a, &out, &error) && Query(&state, t, ns_t_aaaa, &out, &error);
  res_nclose(&state);
  if (!ok) return Failed(error);
  return Finish(std::move(out));
}

}  // namespace

absl::StatusOr<DnsTarget> ParseDnsTarget(const std::string& spec) {
  DnsTarget t;
  t.spec = spec;
  absl::string_view rest = spec;
  if (absl::ConsumePrefix(&rest, "dns://")) {
    const auto slash = rest.find('/');
    if (slash == absl::string_view::npos || slash == 0) {
      return absl::InvalidArgumentError(absl::StrCat("'", spec, "': want dns://HOST:PORT/name:port"));
    }
    t.server = std::string(rest.substr(0, slash));
    rest.remove_prefix(slash + 1);
  } else if (absl::StrContains(rest, "://")) {
    return absl::InvalidArgumentError(absl::StrCat("'", spec, "': only dns:// names a DNS server"));
  }
  const auto colon = rest.rfind(':');
  int port = 0;
  if (colon == absl::string_view::npos || colon == 0 || !absl::SimpleAtoi(rest.substr(colon + 1), &port) ||
      port <= 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("worker name '", spec, "' needs name:port"));
  }
  t.name = std::string(rest.substr(0, colon));
  t.port = std::string(rest.substr(colon + 1));
  return t;
}

DnsAnswer Resolve(const DnsTarget& target, absl::Duration timeout) {
  return target.server.empty() ? ResolveSystem(target) : ResolveAt(target, timeout);
}

const char* DnsResultName(DnsAnswer::Result r) {
  switch (r) {
    case DnsAnswer::Result::kOk:
      return "ok";
    case DnsAnswer::Result::kEmpty:
      return "empty";
    case DnsAnswer::Result::kFailed:
      return "failed";
  }
  return "failed";
}

}  // namespace kvcache::router
