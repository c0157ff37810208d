#include "tests/testing/child_process.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/peer_auth.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "reflection_v1alpha.grpc.pb.h"

extern char** environ;

namespace kvcache::testing {

std::string BinaryPath(const std::string& relative) {
  const char* dir = std::getenv("KVCACHE_BUILD_DIR");
  return absl::StrCat(dir != nullptr ? dir : ".", "/", relative);
}

absl::StatusOr<std::unique_ptr<ChildProcess>> ChildProcess::Start(const std::vector<std::string>& argv) {
  if (argv.empty()) return absl::InvalidArgumentError("empty argv");
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return absl::InternalError(absl::StrCat("pipe: ", strerror(errno)));
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  // Children start with default signal handling, whatever the test runner has.
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t none;
  sigemptyset(&none);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK);
  pid_t pid = -1;
  int rc = posix_spawn(&pid, args[0], &actions, &attr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  close(fds[1]);
  if (rc != 0) {
    close(fds[0]);
    return absl::NotFoundError(absl::StrCat("cannot start ", argv[0], ": ", strerror(rc)));
  }
  std::unique_ptr<ChildProcess> p(new ChildProcess());
  p->pid_ = pid;
  p->stdout_fd_ = fds[0];
  return p;
}

ChildProcess::~ChildProcess() {
  if (!exited_) Stop();
  if (stdout_fd_ >= 0) close(stdout_fd_);
}

absl::StatusOr<std::string> ChildProcess::WaitForLine(const std::string& needle, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    // Look for a complete line holding the needle in what we have.
    size_t pos;
    while ((pos = output_.find('\n', scanned_)) != std::string::npos) {
      std::string line = output_.substr(scanned_, pos - scanned_);
      scanned_ = pos + 1;
      if (absl::StrContains(line, needle)) return line;
    }
    absl::Status st = ReadSome(deadline);
    if (absl::IsDeadlineExceeded(st)) {
      return absl::DeadlineExceededError(absl::StrCat("no line with '", needle, "' from pid ", pid_));
    }
    if (absl::IsFailedPrecondition(st)) {
      return absl::FailedPreconditionError(
          absl::StrCat("pid ", pid_, " closed stdout before printing '", needle, "'"));
    }
    if (!st.ok()) return st;
  }
}

absl::Status ChildProcess::ReadSome(absl::Time deadline) {
  const absl::Duration left = deadline - absl::Now();
  if (left <= absl::ZeroDuration()) return absl::DeadlineExceededError("timed out");
  pollfd pfd{stdout_fd_, POLLIN, 0};
  int n = poll(&pfd, 1, static_cast<int>(absl::ToInt64Milliseconds(left)) + 1);
  if (n < 0 && errno != EINTR) return absl::InternalError(strerror(errno));
  if (n <= 0) return absl::OkStatus();
  char buf[4096];
  ssize_t got = read(stdout_fd_, buf, sizeof(buf));
  if (got > 0) {
    output_.append(buf, static_cast<size_t>(got));
  } else if (got == 0) {
    return absl::FailedPreconditionError("stdout closed");
  }
  return absl::OkStatus();
}

absl::Status ChildProcess::WaitForOutput(size_t bytes, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (output_.size() < bytes) {
    absl::Status st = ReadSome(deadline);
    if (!st.ok()) {
      return absl::Status(st.code(), absl::StrCat("pid ", pid_, " printed ", output_.size(), " of ", bytes,
                                                  " bytes: ", st.message()));
    }
  }
  return absl::OkStatus();
}

void ChildProcess::Signal(int sig) {
  if (!exited_) kill(pid_, sig);
}

absl::StatusOr<int> ChildProcess::Wait(absl::Duration timeout) {
  if (exited_) return wait_status_;
  const absl::Time deadline = absl::Now() + timeout;
  // A pidfd would avoid polling, but glibc 2.36 has no wrapper for waiting with a
  // timeout on it; short waitpid polls keep this simple and bounded.
  while (true) {
    int status = 0;
    pid_t r = waitpid(pid_, &status, WNOHANG);
    if (r == pid_) {
      exited_ = true;
      wait_status_ = status;
      return status;
    }
    if (absl::Now() >= deadline)
      return absl::DeadlineExceededError(absl::StrCat("pid ", pid_, " still running"));
    absl::SleepFor(absl::Milliseconds(5));
  }
}

int ChildProcess::Stop(absl::Duration grace) {
  if (exited_) return wait_status_;
  kill(pid_, SIGCONT);  // a stopped process cannot handle SIGTERM
  kill(pid_, SIGTERM);
  auto st = Wait(grace);
  if (st.ok()) return *st;
  kill(pid_, SIGKILL);
  return Wait(absl::Seconds(30)).value_or(-1);
}

namespace {

// A tokens file with kTestAdminToken as tenant "default", admin: written on
// first use, removed when the test process exits.
absl::StatusOr<std::string> AdminTokensFile() {
  struct File {
    File() {
      const char* tmp = std::getenv("TEST_TMPDIR");
      path = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/kvcache_test_admin_tokens_", getpid(), ".txt");
      FILE* f = std::fopen(path.c_str(), "w");
      if (f == nullptr) {
        status = absl::InternalError(absl::StrCat("cannot write ", path));
        return;
      }
      std::fprintf(f, "%s default admin\n", kTestAdminToken);
      if (std::fclose(f) != 0) status = absl::InternalError(absl::StrCat("cannot write ", path));
    }
    ~File() { std::remove(path.c_str()); }
    std::string path;
    absl::Status status;
  };
  static const File file;  // thread-safe initialisation; the destructor runs at exit
  if (!file.status.ok()) return file.status;
  return file.path;
}

}  // namespace

std::shared_ptr<grpc::Channel> ServerUnderTest::admin_channel() const {
  return NewBearerChannel(grpc_address_, grpc::InsecureChannelCredentials(), kTestAdminToken);
}

absl::StatusOr<std::unique_ptr<ServerUnderTest>> ServerUnderTest::Start(const std::string& binary,
                                                                        std::vector<std::string> extra_args,
                                                                        absl::Duration ready_timeout) {
  std::vector<std::string> argv = {binary, "--listen=127.0.0.1:0", "--metrics_listen=127.0.0.1:0"};
  const bool has_auth = std::any_of(extra_args.begin(), extra_args.end(), [](const std::string& a) {
    for (const char* flag :
         {"--allow_unauthenticated", "--auth_tokens_file", "--cluster_token_file", "--tls_client_ca"}) {
      if (absl::StartsWith(a, flag)) return true;
    }
    return false;
  });
  if (!has_auth) {
    argv.push_back("--allow_unauthenticated");
    if (absl::EndsWith(binary, "kvcache-router")) {
      auto tokens = AdminTokensFile();
      if (!tokens.ok()) return tokens.status();
      argv.push_back("--auth_tokens_file=" + *tokens);
    }
  }
  argv.insert(argv.end(), extra_args.begin(), extra_args.end());
  auto process = ChildProcess::Start(argv);
  if (!process.ok()) return process.status();
  std::unique_ptr<ServerUnderTest> s(new ServerUnderTest());
  s->process_ = std::move(*process);
  auto line = s->process_->WaitForLine(" listening grpc=", ready_timeout);
  if (!line.ok()) return line.status();
  // "<name> listening grpc=HOST:PORT metrics=HOST:PORT|off"
  for (absl::string_view field : absl::StrSplit(*line, ' ')) {
    if (absl::ConsumePrefix(&field, "grpc=")) s->grpc_address_ = std::string(field);
    if (absl::ConsumePrefix(&field, "metrics=") && field != "off") {
      auto colon = field.rfind(':');
      if (!absl::SimpleAtoi(field.substr(colon + 1), &s->metrics_port_)) {
        return absl::InternalError(absl::StrCat("bad metrics address in: ", *line));
      }
    }
  }
  if (s->grpc_address_.empty()) return absl::InternalError(absl::StrCat("no grpc address in: ", *line));
  s->channel_ = grpc::CreateChannel(s->grpc_address_, grpc::InsecureChannelCredentials());
  auto ready = WaitForServing(s->channel_, "readiness", ready_timeout);
  if (!ready.ok()) return ready;
  return s;
}

absl::StatusOr<std::string> HealthCheck(const std::shared_ptr<grpc::Channel>& channel,
                                        const std::string& service) {
  auto stub = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  ctx.set_wait_for_ready(true);
  grpc::health::v1::HealthCheckRequest req;
  req.set_service(service);
  grpc::health::v1::HealthCheckResponse resp;
  grpc::Status st = stub->Check(&ctx, req, &resp);
  if (!st.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(st.error_code()), st.error_message());
  }
  return grpc::health::v1::HealthCheckResponse::ServingStatus_Name(resp.status());
}

std::pair<int, std::string> RunToExit(const std::string& command, absl::Duration timeout) {
  // exec: the command is the child, so that a timeout stops it too (the shell
  // alone went, and the command ran on).
  auto p = ChildProcess::Start({"/bin/sh", "-c", "exec " + command + " 2>&1"});
  if (!p.ok()) return {-1, p.status().ToString()};
  auto status = (*p)->Wait(timeout);
  if (!status.ok()) return {-1, status.status().ToString()};
  (void)(*p)->WaitForOutput(1 << 20, absl::Seconds(5));
  return {WIFEXITED(*status) ? WEXITSTATUS(*status) : -1, (*p)->output()};
}

absl::Status WaitForServing(const std::shared_ptr<grpc::Channel>& channel, const std::string& service,
                            absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  absl::Status last = absl::DeadlineExceededError("no health answer");
  while (absl::Now() < deadline) {
    // wait_for_ready makes each probe block until the channel connects (bounded
    // by its own deadline), so this loop does not spin.
    auto status = HealthCheck(channel, service);
    if (status.ok() && *status == "SERVING") return absl::OkStatus();
    last = status.ok() ? absl::UnavailableError(*status) : status.status();
    if (status.ok()) {
      // Served but not ready yet: wait on the Watch stream for a change instead of
      // polling.
      auto stub = grpc::health::v1::Health::NewStub(channel);
      grpc::ClientContext ctx;
      ctx.set_deadline(absl::ToChronoTime(deadline));
      grpc::health::v1::HealthCheckRequest req;
      req.set_service(service);
      auto reader = stub->Watch(&ctx, req);
      grpc::health::v1::HealthCheckResponse resp;
      while (reader->Read(&resp)) {
        if (resp.status() == grpc::health::v1::HealthCheckResponse::SERVING) {
          ctx.TryCancel();
          reader->Finish();
          return absl::OkStatus();
        }
      }
      reader->Finish();
    }
  }
  return absl::DeadlineExceededError(absl::StrCat("health '", service, "' not SERVING: ", last.ToString()));
}

absl::StatusOr<std::vector<std::string>> ReflectionListServices(
    const std::shared_ptr<grpc::Channel>& channel) {
  auto stub = grpc::reflection::v1alpha::ServerReflection::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  auto stream = stub->ServerReflectionInfo(&ctx);
  grpc::reflection::v1alpha::ServerReflectionRequest req;
  req.set_list_services("*");
  if (!stream->Write(req)) return absl::UnavailableError("reflection write failed");
  stream->WritesDone();
  grpc::reflection::v1alpha::ServerReflectionResponse resp;
  std::vector<std::string> names;
  while (stream->Read(&resp)) {
    for (const auto& s : resp.list_services_response().service()) names.push_back(s.name());
  }
  grpc::Status st = stream->Finish();
  if (!st.ok()) return absl::UnavailableError(st.error_message());
  return names;
}

// Threads of process `pid` (the Threads: line of /proc/<pid>/status), or -1.
int ThreadCount(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    absl::string_view v = line;
    if (absl::ConsumePrefix(&v, "Threads:")) {
      int n = 0;
      return absl::SimpleAtoi(absl::StripAsciiWhitespace(v), &n) ? n : -1;
    }
  }
  return -1;
}

std::optional<double> MetricSample(const std::string& exposition, const std::string& series) {
  const std::string line_start = series + " ";
  for (size_t at = 0; at < exposition.size();) {
    size_t end = exposition.find('\n', at);
    if (end == std::string::npos) end = exposition.size();
    if (exposition.compare(at, line_start.size(), line_start) == 0) {
      return std::strtod(exposition.c_str() + at + line_start.size(), nullptr);
    }
    at = end + 1;
  }
  return std::nullopt;
}

absl::StatusOr<std::string> HttpGet(int port, const std::string& path) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError(strerror(errno));
  timeval tv{10, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    std::string err = strerror(errno);
    close(fd);
    return absl::UnavailableError(absl::StrCat("connect 127.0.0.1:", port, ": ", err));
  }
  std::string req = absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
  if (write(fd, req.data(), req.size()) != static_cast<ssize_t>(req.size())) {
    close(fd);
    return absl::UnavailableError("short write");
  }
  std::string resp;
  char buf[8192];
  ssize_t n;
  while ((n = read(fd, buf, sizeof(buf))) > 0) resp.append(buf, static_cast<size_t>(n));
  close(fd);
  auto header_end = resp.find("\r\n\r\n");
  if (header_end == std::string::npos) return absl::UnavailableError("no HTTP header in response");
  if (!absl::StartsWith(resp, "HTTP/1.1 200") && !absl::StartsWith(resp, "HTTP/1.0 200")) {
    return absl::UnavailableError(absl::StrCat("HTTP status: ", resp.substr(0, resp.find('\r'))));
  }
  return resp.substr(header_end + 4);
}

}  // namespace kvcache::testing
