#include "common/init.h"

#include <cstdio>
#include <cstdlib>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/flags_usage.h"
#include "common/logging.h"
#include "common/status.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:0", "gRPC listen address host:port (port 0 picks a free port)");
ABSL_FLAG(std::string, metrics_listen, "127.0.0.1:0",
          "Prometheus /metrics listen address host:port (port 0 picks a free port; empty disables)");
ABSL_FLAG(absl::Duration, shutdown_deadline, absl::Seconds(10),
          "On SIGTERM, how long running RPCs may take to finish");
ABSL_FLAG(
    absl::Duration, keepalive_time, absl::Seconds(30),
    "Ping every gRPC connection (accepted, and to peers) after this long without one, so that a peer that "
    "vanished without closing it is noticed; 0 disables");
ABSL_FLAG(
    absl::Duration, keepalive_timeout, absl::Seconds(10),
    "A keepalive ping unanswered this long closes the connection (its calls fail or are cancelled); keep "
    "it above 5s, as gRPC C++ clients with no call open answer pings every 5s");
ABSL_FLAG(absl::Duration, max_connection_age, absl::ZeroDuration(),
          "Ask clients to reconnect after a connection has lived this long (behind a Kubernetes Service: "
          "spreads long-lived clients over replicas added later); 0: never");
ABSL_FLAG(absl::Duration, max_connection_age_grace, absl::Minutes(10),
          "After --max_connection_age, how long calls in flight on the old connection may take to finish");
ABSL_FLAG(std::string, tls_cert, "", "PEM server certificate chain (enables TLS)");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_client_ca, "", "PEM CA bundle: require and verify client certificates (mTLS)");
ABSL_FLAG(std::string, cluster_token_file, "",
          "File holding the fleet's shared token (a Secret): workers require it of every caller, routers "
          "and migrating workers send it");
ABSL_FLAG(bool, allow_unauthenticated, false,
          "Serve callers without credentials (worker: anyone who reaches the port; router: callers "
          "without a bearer token act as tenant 'default', never admin). Off by default");

namespace kvcache {
namespace {

absl::Status ValidateAddress(const std::string& flag, const std::string& address, bool allow_empty) {
  if (address.empty()) {
    if (allow_empty) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat("--", flag, " is empty"));
  }
  auto pos = address.rfind(':');
  int port = 0;
  if (pos == std::string::npos || pos == 0 || !absl::SimpleAtoi(address.substr(pos + 1), &port) || port < 0 ||
      port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, "='", address, "': want host:port with port in [0, 65535]"));
  }
  return absl::OkStatus();
}

}  // namespace

void InitProcess(int argc, char** argv, const std::string& name, const std::string& usage) {
  SetFlagsUsage(usage);
  std::vector<char*> rest = absl::ParseCommandLine(argc, argv);
  if (rest.size() > 1) {
    std::fprintf(stderr, "%s: unexpected argument '%s' (flags are --name=value; see --help)\n", name.c_str(),
                 rest[1]);
    std::exit(2);
  }
  InitLogging(name);
}

absl::StatusOr<ServerOptions> ServerOptionsFromFlags(const std::string& name) {
  ServerOptions o;
  o.name = name;
  o.grpc_address = absl::GetFlag(FLAGS_listen);
  o.metrics_address = absl::GetFlag(FLAGS_metrics_listen);
  o.shutdown_deadline = absl::GetFlag(FLAGS_shutdown_deadline);
  o.keepalive.time = absl::GetFlag(FLAGS_keepalive_time);
  o.keepalive.timeout = absl::GetFlag(FLAGS_keepalive_timeout);
  o.max_connection_age = absl::GetFlag(FLAGS_max_connection_age);
  o.max_connection_age_grace = absl::GetFlag(FLAGS_max_connection_age_grace);
  o.tls_cert_file = absl::GetFlag(FLAGS_tls_cert);
  o.tls_key_file = absl::GetFlag(FLAGS_tls_key);
  o.tls_client_ca_file = absl::GetFlag(FLAGS_tls_client_ca);
  o.cluster_token_file = absl::GetFlag(FLAGS_cluster_token_file);
  o.allow_unauthenticated = absl::GetFlag(FLAGS_allow_unauthenticated);
  KVCACHE_RETURN_IF_ERROR(ValidateAddress("listen", o.grpc_address, false));
  KVCACHE_RETURN_IF_ERROR(ValidateAddress("metrics_listen", o.metrics_address, true));
  KVCACHE_RETURN_IF_ERROR(o.keepalive.Validate());
  if (o.max_connection_age < absl::ZeroDuration() || o.max_connection_age_grace < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        "--max_connection_age and --max_connection_age_grace must not be negative");
  }
  if (o.shutdown_deadline < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--shutdown_deadline must not be negative");
  }
  return o;
}

void DieWith(const std::string& name, const absl::Status& status, int code) {
  std::fprintf(stderr, "%s: %s\n", name.c_str(), status.ToString().c_str());
  std::exit(code);
}

}  // namespace kvcache
