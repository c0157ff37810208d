// gRPC keepalive (HTTP/2 PING) for the connections a server accepts and the
// channels it opens to its peers (router -> worker, worker -> worker).
//
// Without it a peer that vanishes without closing its connection (its node lost
// power, a network partition, a NAT or conntrack entry dropped) leaves the
// connection open for as long as TCP allows: a router's streams to such a worker
// hang until their deadlines, and a worker keeps generating for a client that is
// gone, its session busy. With it, a peer that leaves a ping unanswered for
// `timeout` is cut: its calls fail (a router continues them on another worker),
// and the other side's requests are cancelled.
//
// Both sides also accept pings from peers as often as kMinPeerPingInterval,
// with no call open and on streams that carry no data for a while (a long
// prompt): gRPC's defaults (one ping in 5 minutes) would close the connection
// of a client, or a proxy such as Envoy, that pings every 10 or 30 s.
#ifndef KVCACHE_COMMON_KEEPALIVE_H_
#define KVCACHE_COMMON_KEEPALIVE_H_

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"

namespace kvcache {

// A duration as a gRPC channel argument: milliseconds, clamped to [0, INT_MAX].
int MillisArg(absl::Duration d);

struct Keepalive {
  // Ping a connection after this long without one; zero: never (pings from
  // peers are still answered and accepted).
  absl::Duration time = absl::Seconds(30);
  // A ping unanswered for this long closes the connection. Keep it above 5 s:
  // a gRPC C++ client with no call open answers pings only that often (its
  // channel's backup poller), and would be cut while alive.
  absl::Duration timeout = absl::Seconds(10);

  static constexpr absl::Duration kMinPeerPingInterval = absl::Seconds(1);

  // INVALID_ARGUMENT for a negative time or a timeout that is not positive.
  absl::Status Validate() const;
  // Server side: ping clients, and accept their pings.
  void ApplyTo(grpc::ServerBuilder* builder) const;
  // Client side: arguments for a channel to a peer.
  grpc::ChannelArguments ChannelArgs() const;
};

}  // namespace kvcache

#endif  // KVCACHE_COMMON_KEEPALIVE_H_
