// The one place where absl::Status and grpc::Status meet.
//
// Library code returns absl::Status; service edges convert with ToGrpcStatus and
// clients convert back with FromGrpcStatus. Codes map one to one (both follow
// google.rpc.Code).
//
// Thread-safety: free functions, no state.
#ifndef KVCACHE_COMMON_STATUS_H_
#define KVCACHE_COMMON_STATUS_H_

#include "absl/status/status.h"
#include "common/status_macros.h"
#include "grpcpp/support/status.h"

namespace kvcache {

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace kvcache

#endif  // KVCACHE_COMMON_STATUS_H_
