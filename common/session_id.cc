#include "common/session_id.h"

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace kvcache {
namespace {

bool IsSessionIdChar(char c) {
  return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == ':' || c == '-';
}

}  // namespace

bool IsValidSessionId(absl::string_view id) {
  return !id.empty() && id.size() <= static_cast<size_t>(kMaxSessionIdBytes) &&
         std::all_of(id.begin(), id.end(), IsSessionIdChar);
}

absl::Status ValidateSessionId(absl::string_view id) {
  if (id.empty() || id.size() > static_cast<size_t>(kMaxSessionIdBytes)) {
    return absl::InvalidArgumentError(
        absl::StrCat("session_id must be 1..", kMaxSessionIdBytes, " bytes, got ", id.size()));
  }
  if (!IsValidSessionId(id)) return absl::InvalidArgumentError("session_id may only hold [A-Za-z0-9._:-]");
  return absl::OkStatus();
}

}  // namespace kvcache
