// Early-return helpers for absl::Status and absl::StatusOr, usable by every
// library (no gRPC dependency; the gRPC mapping lives in common/status.h).
//
// Thread-safety: macros only.
#ifndef KVCACHE_COMMON_STATUS_MACROS_H_
#define KVCACHE_COMMON_STATUS_MACROS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

// Returns early from the enclosing function when `expr` is not OK.
#define KVCACHE_RETURN_IF_ERROR(expr)                  \
  do {                                                 \
    ::absl::Status _kvcache_status = (expr);           \
    if (!_kvcache_status.ok()) return _kvcache_status; \
  } while (0)

#define KVCACHE_CONCAT_INNER(a, b) a##b
#define KVCACHE_CONCAT(a, b) KVCACHE_CONCAT_INNER(a, b)

// `KVCACHE_ASSIGN_OR_RETURN(auto x, StatusOrExpr());`
#define KVCACHE_ASSIGN_OR_RETURN(lhs, expr) \
  KVCACHE_ASSIGN_OR_RETURN_IMPL(KVCACHE_CONCAT(_kvcache_or_, __LINE__), lhs, expr)
#define KVCACHE_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                  \
  if (!tmp.ok()) return tmp.status();                 \
  lhs = std::move(tmp).value()

#endif  // KVCACHE_COMMON_STATUS_MACROS_H_
