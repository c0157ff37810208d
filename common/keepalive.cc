#include "common/keepalive.h"

#include <algorithm>
#include <cstdint>
#include <limits>

namespace kvcache {
namespace {

// Pings sent without data in between are unlimited (gRPC's client default,
// 2, stops a keepalive on a stream waiting for a long prompt).
constexpr int kUnlimitedPingsWithoutData = 0;

}  // namespace

int MillisArg(absl::Duration d) {
  return static_cast<int>(
      std::clamp<int64_t>(absl::ToInt64Milliseconds(d), 0, std::numeric_limits<int>::max()));
}

absl::Status Keepalive::Validate() const {
  if (time < absl::ZeroDuration()) return absl::InvalidArgumentError("--keepalive_time must not be negative");
  if (timeout <= absl::ZeroDuration())
    return absl::InvalidArgumentError("--keepalive_timeout must be positive");
  return absl::OkStatus();
}

void Keepalive::ApplyTo(grpc::ServerBuilder* builder) const {
  if (time > absl::ZeroDuration()) {
    builder->AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, MillisArg(time));
    builder->AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, MillisArg(timeout));
    builder->AddChannelArgument(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, kUnlimitedPingsWithoutData);
  }
  builder->AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder->AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
                              MillisArg(kMinPeerPingInterval));
}

grpc::ChannelArguments Keepalive::ChannelArgs() const {
  grpc::ChannelArguments args;
  if (time > absl::ZeroDuration()) {
    // Never more often than a peer with these defaults accepts.
    args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, MillisArg(std::max(time, kMinPeerPingInterval)));
    args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, MillisArg(timeout));
    args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
    args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, kUnlimitedPingsWithoutData);
  }
  return args;
}

}  // namespace kvcache
