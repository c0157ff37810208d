// Worker discovery by DNS: the addresses a name resolves to, each a worker.
//
//   name:port                   the system resolver (getaddrinfo): /etc/hosts,
//                               search domains, the cluster's DNS
//   dns://HOST:PORT/name:port   asks the DNS server at HOST:PORT directly (A and
//                               AAAA records), as gRPC's dns:// authority does
//
// A lookup that fails is kFailed; one that succeeds with no address is kEmpty:
// the caller decides what to keep (WorkerPool keeps the last good answer).
//
// Thread-safety: functions are thread-safe (each lookup has its own resolver state).
#ifndef KVCACHE_ROUTER_DNS_RESOLVER_H_
#define KVCACHE_ROUTER_DNS_RESOLVER_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace kvcache::router {

struct DnsTarget {
  std::string server;  // "HOST:PORT" of a DNS server, empty for the system resolver
  std::string name;
  std::string port;
  std::string spec;  // as given
};

// Parses either form above. INVALID_ARGUMENT names what is wrong.
absl::StatusOr<DnsTarget> ParseDnsTarget(const std::string& spec);

struct DnsAnswer {
  enum class Result { kOk, kEmpty, kFailed };
  Result result = Result::kFailed;
  std::vector<std::string> addresses;  // "ip:port" or "[ip6]:port", sorted, unique
  std::string error;                   // why, when kFailed
};

// One lookup, bounded by `timeout` when a DNS server is named.
DnsAnswer Resolve(const DnsTarget& target, absl::Duration timeout = absl::Seconds(2));

const char* DnsResultName(DnsAnswer::Result r);

}  // namespace kvcache::router

#endif  // KVCACHE_ROUTER_DNS_RESOLVER_H_
