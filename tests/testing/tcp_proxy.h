// A loopback TCP proxy in front of a server, for tests of what happens between
// processes: it forwards bytes both ways until told otherwise.
//
// - HoldAfter(n): once a connection has carried n bytes towards the server, the
//   proxy stops reading from that client (whose writes then block on flow
//   control), e.g. to stop a migration stream mid-way.
// - Freeze(): from then on nothing is forwarded either way, on any connection,
//   and new connections are accepted and left silent, while every socket stays
//   open: a peer that vanished without closing its connections (its node lost
//   power, a partition). Only keepalive pings can tell.
//
// When either end of a connection goes away, the proxy resets the other end, as
// the kernel does when a process dies.
//
// Thread-safety: every method may be called from any thread.
#ifndef KVCACHE_TESTS_TESTING_TCP_PROXY_H_
#define KVCACHE_TESTS_TESTING_TCP_PROXY_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

namespace kvcache::testing {

class TcpProxy {
 public:
  // `upstream`: the server's 127.0.0.1:PORT (loopback only).
  static absl::StatusOr<std::unique_ptr<TcpProxy>> Start(const std::string& upstream);
  ~TcpProxy();
  TcpProxy(const TcpProxy&) = delete;
  TcpProxy& operator=(const TcpProxy&) = delete;

  std::string address() const;

  // Before any traffic: hold each client after `bytes` towards the server.
  void HoldAfter(int64_t bytes) { hold_after_ = bytes; }
  // Whether some connection reached the hold within `timeout`.
  bool WaitForHold(absl::Duration timeout) { return held_.WaitForNotificationWithTimeout(timeout); }

  void Freeze();
  // Whether the server closed a connection after Freeze, within `timeout`.
  bool WaitForServerHangUp(absl::Duration timeout) {
    return server_hung_up_.WaitForNotificationWithTimeout(timeout);
  }

 private:
  explicit TcpProxy(int upstream_port) : upstream_port_(upstream_port) {}
  void Accept();
  void Pump(int client, int upstream);

  const int upstream_port_;
  std::atomic<int64_t> hold_after_{INT64_MAX};
  int listen_fd_ = -1;
  int stop_pipe_[2] = {-1, -1};
  int freeze_pipe_[2] = {-1, -1};  // readable once frozen
  int port_ = 0;
  std::atomic<bool> frozen_{false};
  std::thread acceptor_;
  std::vector<std::thread> pumps_;  // touched by the acceptor only until it is joined
  std::vector<int> silent_;         // connections accepted while frozen (acceptor only)
  std::atomic<bool> held_once_{false};
  absl::Notification held_;
  std::atomic<bool> hung_up_once_{false};
  absl::Notification server_hung_up_;
};

}  // namespace kvcache::testing

#endif  // KVCACHE_TESTS_TESTING_TCP_PROXY_H_
