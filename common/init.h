// Start-up helpers for every kvcache binary: flag parsing, logging, and the
// server flags shared by the router and the worker.
//
// Thread-safety: call from main before starting threads.
#ifndef KVCACHE_COMMON_INIT_H_
#define KVCACHE_COMMON_INIT_H_

#include <string>

#include "absl/status/statusor.h"
#include "common/server.h"

namespace kvcache {

// Parses flags (unknown or malformed flags print a clear error and exit 1),
// rejects positional arguments (exit 2), and starts logging.
void InitProcess(int argc, char** argv, const std::string& name, const std::string& usage);

// ServerOptions from --listen, --metrics_listen, --shutdown_deadline, the
// --tls_* flags, --cluster_token_file and --allow_unauthenticated, validated (INVALID_ARGUMENT names the bad
// flag).
absl::StatusOr<ServerOptions> ServerOptionsFromFlags(const std::string& name);

// Prints "<name>: <status>" to stderr and exits with `code`.
[[noreturn]] void DieWith(const std::string& name, const absl::Status& status, int code = 2);

}  // namespace kvcache

#endif  // KVCACHE_COMMON_INIT_H_
