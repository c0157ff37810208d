#include "tests/testing/tcp_proxy.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace kvcache::testing {
namespace {

bool WriteAll(int fd, const char* data, ssize_t n) {
  while (n > 0) {
    const ssize_t w = write(fd, data, static_cast<size_t>(n));
    if (w <= 0) return false;
    data += w;
    n -= w;
  }
  return true;
}

// Closes with a reset rather than an orderly shutdown.
void Reset(int fd) {
  linger l{1, 0};
  setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof(l));
  close(fd);
}

constexpr short kGone = POLLHUP | POLLERR | POLLRDHUP;

}  // namespace

absl::StatusOr<std::unique_ptr<TcpProxy>> TcpProxy::Start(const std::string& upstream) {
  int upstream_port = 0;
  if (!absl::SimpleAtoi(upstream.substr(upstream.rfind(':') + 1), &upstream_port)) {
    return absl::InvalidArgumentError(absl::StrCat("proxy: '", upstream, "' is not host:port"));
  }
  std::unique_ptr<TcpProxy> p(new TcpProxy(upstream_port));
  p->listen_fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (p->listen_fd_ < 0 || bind(p->listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      listen(p->listen_fd_, 16) != 0 ||
      getsockname(p->listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len) != 0 ||
      pipe2(p->stop_pipe_, O_CLOEXEC) != 0 || pipe2(p->freeze_pipe_, O_CLOEXEC) != 0) {
    return absl::InternalError(absl::StrCat("proxy: ", strerror(errno)));
  }
  p->port_ = ntohs(addr.sin_port);
  p->acceptor_ = std::thread([q = p.get()] { q->Accept(); });
  return p;
}

TcpProxy::~TcpProxy() {
  if (stop_pipe_[1] >= 0) (void)!write(stop_pipe_[1], "x", 1);
  if (acceptor_.joinable()) acceptor_.join();
  for (auto& t : pumps_) t.join();
  for (int fd : silent_) Reset(fd);
  for (int fd : {listen_fd_, stop_pipe_[0], stop_pipe_[1], freeze_pipe_[0], freeze_pipe_[1]}) {
    if (fd >= 0) close(fd);
  }
}

std::string TcpProxy::address() const { return absl::StrCat("127.0.0.1:", port_); }

void TcpProxy::Freeze() {
  if (!frozen_.exchange(true)) (void)!write(freeze_pipe_[1], "x", 1);  // never drained: stays readable
}

void TcpProxy::Accept() {
  while (true) {
    pollfd p[2] = {{listen_fd_, POLLIN, 0}, {stop_pipe_[0], POLLIN, 0}};
    if (poll(p, 2, -1) < 0 && errno == EINTR) continue;
    if (p[1].revents != 0) return;
    const int client = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (client < 0) continue;
    if (frozen_) {  // the server is gone: nothing answers
      silent_.push_back(client);
      continue;
    }
    const int upstream = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(upstream_port_));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(upstream, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      Reset(client);
      Reset(upstream);
      continue;
    }
    pumps_.emplace_back([this, client, upstream] { Pump(client, upstream); });
  }
}

// Forwards both ways until either end closes; holds the client after
// hold_after_ bytes; forwards nothing once frozen, and then only watches for
// either end closing.
void TcpProxy::Pump(int client, int upstream) {
  int64_t forwarded = 0;
  bool holding = false;
  bool frozen = false;
  char buf[64 << 10];
  while (true) {
    pollfd p[4] = {{client, static_cast<short>((holding || frozen ? 0 : POLLIN) | POLLRDHUP), 0},
                   {upstream, static_cast<short>((frozen ? 0 : POLLIN) | POLLRDHUP), 0},
                   {stop_pipe_[0], POLLIN, 0},
                   {frozen ? -1 : freeze_pipe_[0], POLLIN, 0}};
    if (poll(p, 4, -1) < 0) {
      if (errno == EINTR) continue;
      break;
    }
    if (p[2].revents != 0) break;
    if (p[3].revents != 0) {
      frozen = true;
      continue;
    }
    if (frozen) {
      if ((p[1].revents & kGone) != 0 && !hung_up_once_.exchange(true)) server_hung_up_.Notify();
      if (((p[0].revents | p[1].revents) & kGone) != 0) break;
      continue;
    }
    if (!holding && (p[0].revents & (POLLIN | POLLHUP | POLLERR)) != 0) {
      const ssize_t n = read(client, buf, sizeof(buf));
      if (n <= 0 || !WriteAll(upstream, buf, n)) break;
      forwarded += n;
      if (forwarded >= hold_after_) {
        holding = true;
        if (!held_once_.exchange(true)) held_.Notify();
      }
    } else if (holding && (p[0].revents & kGone) != 0) {
      break;  // the held client went away
    }
    if ((p[1].revents & (POLLIN | POLLHUP | POLLERR)) != 0) {
      const ssize_t n = read(upstream, buf, sizeof(buf));
      if (n <= 0 || !WriteAll(client, buf, n)) break;
    }
  }
  Reset(client);
  Reset(upstream);
}

}  // namespace kvcache::testing
