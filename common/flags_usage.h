// --help for every kvcache binary: the program's usage message and the flags
// defined in the project's own files (Abseil's default lists only flags from a
// file named like the binary, which none of ours is, so --help printed none).
#ifndef KVCACHE_COMMON_FLAGS_USAGE_H_
#define KVCACHE_COMMON_FLAGS_USAGE_H_

#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/string_view.h"

namespace kvcache {

// Call once in main, before absl::ParseCommandLine.
inline void SetFlagsUsage(absl::string_view usage) {
  absl::SetProgramUsageMessage(usage);
  absl::FlagsUsageConfig config;
  config.contains_help_flags = [](absl::string_view file) { return !absl::StrContains(file, "absl/"); };
  config.contains_helpshort_flags = config.contains_help_flags;
  absl::SetFlagsUsageConfig(config);
}

}  // namespace kvcache

#endif  // KVCACHE_COMMON_FLAGS_USAGE_H_
