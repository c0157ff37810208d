#include "worker/kv/kv_shape.h"

#include "absl/strings/str_format.h"

namespace kvcache::kv {

const char* DtypeName(KvDtype d) {
  switch (d) {
    case KvDtype::kF32:
      return "f32";
    case KvDtype::kF16:
      return "f16";
    case KvDtype::kBF16:
      return "bf16";
  }
  return "unknown";
}

absl::StatusOr<KvDtype> ParseDtype(absl::string_view name) {
  for (KvDtype d : {KvDtype::kF16, KvDtype::kBF16, KvDtype::kF32}) {
    if (name == DtypeName(d)) return d;
  }
  return absl::InvalidArgumentError(absl::StrFormat("--kv_dtype='%s': want f16, bf16 or f32", name));
}

absl::Status ValidateBudgetFlags(int64_t tier0_bytes, int64_t tier1_bytes, int64_t page_tokens) {
  if (tier0_bytes <= 0) {
    return absl::InvalidArgumentError(absl::StrFormat("--tier0_bytes=%d: must be positive", tier0_bytes));
  }
  if (tier1_bytes < 0) {
    return absl::InvalidArgumentError(absl::StrFormat("--tier1_bytes=%d: must not be negative", tier1_bytes));
  }
  if (page_tokens < 1 || page_tokens > 1024) {
    return absl::InvalidArgumentError(absl::StrFormat("--page_tokens=%d: must be in [1, 1024]", page_tokens));
  }
  return absl::OkStatus();
}

std::string KvShape::DebugString() const {
  return absl::StrFormat("{layers=%d kv_heads=%d head_dim=%d dtype=%s page_tokens=%d window=%d}", layers,
                         kv_heads, head_dim, DtypeName(dtype), page_tokens, sliding_window);
}

absl::Status ValidateShape(const KvShape& s) {
  if (s.layers <= 0 || s.kv_heads <= 0 || s.head_dim <= 0 || s.page_tokens <= 0 || DtypeSize(s.dtype) == 0 ||
      s.sliding_window < 0) {
    return absl::InvalidArgumentError("invalid KV shape " + s.DebugString());
  }
  if (s.page_bytes() > (int64_t{1} << 30)) {
    return absl::InvalidArgumentError("KV page larger than 1 GiB: " + s.DebugString());
  }
  return absl::OkStatus();
}

}  // namespace kvcache::kv
