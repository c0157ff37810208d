// Test helpers: locating and parsing the recorded reference data under
// tests/data/ (JSON, parsed with protobuf's JSON -> Struct so no extra
// dependency is needed), hex decoding, the real model path.
//
// Thread-safety: free functions, no shared state.
#ifndef KVCACHE_TESTS_COMMON_GGUF_REFERENCE_DATA_H_
#define KVCACHE_TESTS_COMMON_GGUF_REFERENCE_DATA_H_

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"

namespace kvcache {
namespace testing {

inline std::string SourceDir() {
  const char* s = std::getenv("KVCACHE_SOURCE_DIR");
  return s != nullptr ? s : ".";
}

inline absl::StatusOr<std::string> ReadFileBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Parses tests/data/<name>.
inline absl::StatusOr<google::protobuf::Struct> LoadReference(const std::string& name) {
  const std::string path = SourceDir() + "/tests/data/" + name;
  auto bytes = ReadFileBytes(path);
  if (!bytes.ok()) return bytes.status();
  google::protobuf::Struct out;
  auto st = google::protobuf::util::JsonStringToMessage(*bytes, &out);
  if (!st.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("bad JSON in ", path, ": ", st.ToString()));
  }
  return out;
}

inline std::string Hex(const google::protobuf::Value& v) { return absl::HexStringToBytes(v.string_value()); }

inline std::vector<float> Floats(const google::protobuf::Value& v) {
  std::vector<float> out;
  for (const auto& x : v.list_value().values()) out.push_back(static_cast<float>(x.number_value()));
  return out;
}

inline std::vector<int32_t> Ints(const google::protobuf::Value& v) {
  std::vector<int32_t> out;
  for (const auto& x : v.list_value().values()) out.push_back(static_cast<int32_t>(x.number_value()));
  return out;
}

}  // namespace testing
}  // namespace kvcache

#endif  // KVCACHE_TESTS_COMMON_GGUF_REFERENCE_DATA_H_
