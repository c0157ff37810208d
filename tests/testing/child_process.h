// Test helpers that run project binaries as real processes on loopback.
//
// ServerUnderTest starts a binary with --listen=127.0.0.1:0 and
// --metrics_listen=127.0.0.1:0, reads the "listening grpc=... metrics=..." line it
// prints, waits until grpc.health.v1 reports SERVING, and always stops the process
// (SIGTERM, then SIGKILL after a grace period) when it goes out of scope.
//
// Thread-safety: not thread-safe; one test thread owns each object.
#ifndef KVCACHE_TESTS_TESTING_CHILD_PROCESS_H_
#define KVCACHE_TESTS_TESTING_CHILD_PROCESS_H_

#include <sys/types.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"

namespace kvcache::testing {

// Path of a binary built by this project (from KVCACHE_BUILD_DIR).
std::string BinaryPath(const std::string& relative);

// A child process with its stdout captured (stderr passes through).
class ChildProcess {
 public:
  // Starts `argv[0]` with `argv`. Fails if the binary cannot be started.
  static absl::StatusOr<std::unique_ptr<ChildProcess>> Start(const std::vector<std::string>& argv);
  ~ChildProcess();  // Stop(), then SIGKILL if needed.

  // Reads stdout until a line containing `needle` arrives (returns the line), the
  // process exits, or `timeout` passes.
  absl::StatusOr<std::string> WaitForLine(const std::string& needle, absl::Duration timeout);

  // Reads stdout until at least `bytes` bytes arrived in all, the process closes
  // it, or `timeout` passes.
  absl::Status WaitForOutput(size_t bytes, absl::Duration timeout);

  // Sends `sig` (e.g. SIGTERM, SIGKILL, SIGSTOP).
  void Signal(int sig);

  // Waits for exit. Returns the exit status as from waitpid, or DEADLINE_EXCEEDED.
  absl::StatusOr<int> Wait(absl::Duration timeout);

  // SIGTERM, wait up to `grace`, then SIGKILL. Returns the waitpid status.
  int Stop(absl::Duration grace = absl::Seconds(10));

  pid_t pid() const { return pid_; }
  bool exited() const { return exited_; }
  // Everything read from stdout so far.
  const std::string& output() const { return output_; }

 private:
  ChildProcess() = default;
  // One poll + read of stdout into output_ (OK when nothing came in time left);
  // DEADLINE_EXCEEDED past `deadline`, FAILED_PRECONDITION once stdout closed.
  absl::Status ReadSome(absl::Time deadline);
  pid_t pid_ = -1;
  int stdout_fd_ = -1;
  bool exited_ = false;
  int wait_status_ = 0;
  std::string output_;
  size_t scanned_ = 0;
};

// The admin token of the tokens file ServerUnderTest gives a router by default.
inline constexpr char kTestAdminToken[] = "kvcache-test-admin-token";

// A server binary started on port 0 and ready (health SERVING).
//
// Authentication: servers refuse to start without credentials unless told
// --allow_unauthenticated. When `extra_args` name none of
// --allow_unauthenticated, --auth_tokens_file, --cluster_token_file and
// --tls_client_ca, Start adds --allow_unauthenticated, and for a router also a
// tokens file whose one token, kTestAdminToken, is tenant "default" and admin
// (admin_channel() sends it).
class ServerUnderTest {
 public:
  static absl::StatusOr<std::unique_ptr<ServerUnderTest>> Start(
      const std::string& binary, std::vector<std::string> extra_args,
      absl::Duration ready_timeout = absl::Seconds(60));

  const std::string& grpc_address() const { return grpc_address_; }
  int metrics_port() const { return metrics_port_; }
  ChildProcess& process() { return *process_; }
  std::shared_ptr<grpc::Channel> channel() const { return channel_; }
  // A channel whose calls carry kTestAdminToken (for a router's admin calls).
  std::shared_ptr<grpc::Channel> admin_channel() const;

 private:
  std::unique_ptr<ChildProcess> process_;
  std::string grpc_address_;
  int metrics_port_ = 0;
  std::shared_ptr<grpc::Channel> channel_;
};

// Runs `command` (one simple command, which /bin/sh execs) until it exits (at
// most `timeout`, then it is stopped): its exit code (-1 unless it exited, or
// when it could not run) and its stdout and stderr together (the reason, when
// it could not run).
std::pair<int, std::string> RunToExit(const std::string& command, absl::Duration timeout = absl::Seconds(60));

// grpc.health.v1 Check of `service` over `channel`: SERVING, NOT_SERVING, ...
absl::StatusOr<std::string> HealthCheck(const std::shared_ptr<grpc::Channel>& channel,
                                        const std::string& service);

// Polls HealthCheck until it reports SERVING or `timeout` passes. Each probe waits
// for the channel to connect, so no sleeps are involved.
absl::Status WaitForServing(const std::shared_ptr<grpc::Channel>& channel, const std::string& service,
                            absl::Duration timeout);

// Polls `done` every 10 ms until it holds or `timeout` passes; returns its last
// value. For state a test can only observe from outside (a router's view over
// ListWorkers, a metric): a bounded wait on a condition, not a sleep to order
// events.
template <typename F>
bool WaitUntil(F done, absl::Duration timeout = absl::Seconds(30)) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    if (done()) return true;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return done();
}

// Service names listed by server reflection (v1alpha).
absl::StatusOr<std::vector<std::string>> ReflectionListServices(
    const std::shared_ptr<grpc::Channel>& channel);

// Threads of process `pid` (the Threads: line of /proc/<pid>/status), or -1.
int ThreadCount(pid_t pid);

// HTTP/1.0 GET of http://127.0.0.1:port/path; returns the body on status 200.
absl::StatusOr<std::string> HttpGet(int port, const std::string& path);

// The value of one sample of a Prometheus text exposition, named as it is
// written there (`name` or `name{label="value",...}`); nullopt when absent.
std::optional<double> MetricSample(const std::string& exposition, const std::string& series);

}  // namespace kvcache::testing

#endif  // KVCACHE_TESTS_TESTING_CHILD_PROCESS_H_
