#include "common/memory_limit.h"

#include <fstream>
#include <limits>
#include <sstream>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace kvcache {
namespace {

// Limits at or above this are "no limit" (v1 writes 2^63 rounded down to a page).
constexpr int64_t kUnlimited = int64_t{1} << 62;

std::optional<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// The cgroup path of the line of /proc/self/cgroup whose controller list
// satisfies `match`.
template <typename Match>
std::optional<std::string> CgroupPath(const std::string& proc_cgroup, Match match) {
  for (absl::string_view line : absl::StrSplit(proc_cgroup, '\n', absl::SkipEmpty())) {
    std::vector<absl::string_view> fields = absl::StrSplit(line, absl::MaxSplits(':', 2));
    if (fields.size() == 3 && match(fields[0], fields[1])) return std::string(fields[2]);
  }
  return std::nullopt;
}

// The least limit in `file` of `dir`/`path` and each ancestor of `path`.
std::optional<CgroupLimit> LeastLimit(const std::string& dir, std::string path, const std::string& file) {
  std::optional<CgroupLimit> least;
  while (true) {
    const std::string at = dir + (path == "/" ? "" : path) + "/" + file;
    if (std::optional<std::string> text = ReadFile(at)) {
      int64_t bytes = 0;
      if (absl::SimpleAtoi(absl::StripAsciiWhitespace(*text), &bytes) && bytes > 0 && bytes < kUnlimited &&
          (!least || bytes < least->bytes)) {
        least = CgroupLimit{bytes, at};
      }
    }
    if (path.empty() || path == "/") break;
    const size_t slash = path.rfind('/');
    path = slash == 0 || slash == std::string::npos ? "/" : path.substr(0, slash);
  }
  return least;
}

}  // namespace

std::optional<CgroupLimit> CgroupMemoryLimit(const std::string& proc_cgroup, const std::string& root) {
  // A v1 memory hierarchy: "N:...memory...:/path".
  auto v1 = CgroupPath(proc_cgroup, [](absl::string_view id, absl::string_view controllers) {
    if (id == "0") return false;
    for (absl::string_view c : absl::StrSplit(controllers, ',')) {
      if (c == "memory") return true;
    }
    return false;
  });
  if (v1) return LeastLimit(root + "/memory", *v1, "memory.limit_in_bytes");
  // The v2 unified hierarchy: "0::/path".
  auto v2 = CgroupPath(proc_cgroup, [](absl::string_view id, absl::string_view controllers) {
    return id == "0" && controllers.empty();
  });
  if (v2) return LeastLimit(root, *v2, "memory.max");  // "max" (no limit) does not parse
  return std::nullopt;
}

std::optional<CgroupLimit> ProcessMemoryLimit() {
  std::optional<std::string> proc = ReadFile("/proc/self/cgroup");
  if (!proc) return std::nullopt;
  return CgroupMemoryLimit(*proc, "/sys/fs/cgroup");
}

int64_t WorkerHostBytes(int64_t host_tier0, int64_t tier1, int64_t weights) {
  int64_t sum = 0;
  for (int64_t part : {host_tier0, tier1, weights, kWorkerProcessBytes}) {
    sum = part > std::numeric_limits<int64_t>::max() - sum ? std::numeric_limits<int64_t>::max() : sum + part;
  }
  return sum;
}

std::optional<int64_t> PhysicalMemoryBytes() {
  std::optional<std::string> meminfo = ReadFile("/proc/meminfo");
  if (!meminfo) return std::nullopt;
  for (absl::string_view line : absl::StrSplit(*meminfo, '\n')) {
    if (!absl::ConsumePrefix(&line, "MemTotal:")) continue;
    line = absl::StripAsciiWhitespace(line);
    if (!absl::ConsumeSuffix(&line, "kB")) return std::nullopt;
    int64_t kb = 0;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(line), &kb)) return std::nullopt;
    return kb * 1024;
  }
  return std::nullopt;
}

}  // namespace kvcache
