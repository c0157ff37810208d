// Read-only view of a GGUF file (the llama.cpp model format): header,
// metadata key/values, tensor infos and memory-mapped tensor data.
//
// Everything read from the file is validated before use: a truncated,
// corrupted or hostile file yields INVALID_ARGUMENT naming what is wrong,
// never a crash, and allocations are bounded by the file size.
//
//   KVCACHE_ASSIGN_OR_RETURN(auto file, GgufFile::Open(path));
//   const GgufTensorInfo* t = file->FindTensor("blk.0.attn_q.weight");
//   // t->data: t->ne[1] rows of t->row_bytes bytes, each t->ne[0] elements.
//
// Thread-safety: a GgufFile is immutable after Open; const methods are safe
// from any number of threads. Pointers and string_views it hands out live as
// long as the GgufFile.
#ifndef KVCACHE_COMMON_GGUF_GGUF_READER_H_
#define KVCACHE_COMMON_GGUF_GGUF_READER_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/gguf/ggml_types.h"

namespace kvcache {
namespace gguf {

// Values are the GGUF on-disk `gguf_type` codes.
enum class GgufValueType : uint32_t {
  kUint8 = 0,
  kInt8 = 1,
  kUint16 = 2,
  kInt16 = 3,
  kUint32 = 4,
  kInt32 = 5,
  kFloat32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kUint64 = 10,
  kInt64 = 11,
  kFloat64 = 12,
};

absl::string_view ValueTypeName(GgufValueType type);

// Limits applied while parsing (beyond "fits in the file").
struct GgufLimits {
  static constexpr uint64_t kMaxTensors = 1 << 20;
  static constexpr uint64_t kMaxKeyValues = 1 << 20;
  static constexpr uint64_t kMaxStringBytes = 1 << 28;
  static constexpr uint64_t kMaxArrayElements = 1 << 28;
  static constexpr uint32_t kMaxDims = 4;       // GGML_MAX_DIMS
  static constexpr size_t kMaxTensorName = 63;  // GGML_MAX_NAME - 1
  static constexpr uint32_t kMaxAlignment = 1 << 16;
};

// One metadata value: a scalar, a string or a one-level array of those.
// Strings are views into the file's bytes.
class GgufValue {
 public:
  GgufValueType type() const { return type_; }
  bool is_array() const { return type_ == GgufValueType::kArray; }
  // REQUIRES: is_array().
  GgufValueType array_type() const { return array_type_; }
  uint64_t array_size() const { return array_size_; }

  // Scalars, converted when lossless: AsUint64/AsInt64 accept any integer type
  // whose value fits, AsDouble any integer or float. INVALID_ARGUMENT otherwise.
  absl::StatusOr<uint64_t> AsUint64() const;
  absl::StatusOr<int64_t> AsInt64() const;
  absl::StatusOr<double> AsDouble() const;
  absl::StatusOr<bool> AsBool() const;
  absl::StatusOr<absl::string_view> AsString() const;

  // Arrays of strings / integers / numbers.
  absl::StatusOr<std::vector<absl::string_view>> AsStringArray() const;
  absl::StatusOr<std::vector<int64_t>> AsIntArray() const;
  absl::StatusOr<std::vector<double>> AsDoubleArray() const;

  // Human-readable rendering (arrays abbreviated), for tools and errors.
  std::string DebugString() const;

 private:
  friend class GgufParser;
  GgufValueType type_ = GgufValueType::kUint8;
  uint64_t bits_ = 0;      // integer/bool payload, or the bits of a float/double
  absl::string_view str_;  // kString
  GgufValueType array_type_ = GgufValueType::kUint8;
  uint64_t array_size_ = 0;
  const uint8_t* array_data_ = nullptr;     // numeric arrays: packed elements
  std::vector<absl::string_view> strings_;  // string arrays
};

struct GgufTensorInfo {
  std::string name;
  GgmlType type = GgmlType::kF32;
  int n_dims = 0;
  // ggml order: ne[0] is the innermost (contiguous) dimension; unused dims are 1.
  std::array<int64_t, GgufLimits::kMaxDims> ne = {1, 1, 1, 1};
  uint64_t offset = 0;            // from the start of the data section
  int64_t row_bytes = 0;          // bytes of one ne[0]-element row
  int64_t size_bytes = 0;         // row_bytes * ne[1] * ne[2] * ne[3]
  const uint8_t* data = nullptr;  // into the mapping; alignment() aligned

  int64_t num_elements() const { return ne[0] * ne[1] * ne[2] * ne[3]; }
  int64_t num_rows() const { return ne[1] * ne[2] * ne[3]; }
  // "[576, 49152]"
  std::string ShapeString() const;
};

class GgufFile {
 public:
  // Memory-maps `path` read-only. NOT_FOUND when the file does not exist,
  // INVALID_ARGUMENT when it is not a valid GGUF file.
  static absl::StatusOr<std::unique_ptr<GgufFile>> Open(const std::string& path);
  // Parses an in-memory copy (fuzzing, tests). Same validation as Open.
  static absl::StatusOr<std::unique_ptr<GgufFile>> OpenFromBuffer(std::string bytes);

  ~GgufFile();
  GgufFile(const GgufFile&) = delete;
  GgufFile& operator=(const GgufFile&) = delete;

  uint32_t version() const { return version_; }
  uint32_t alignment() const { return alignment_; }
  size_t file_size() const { return size_; }
  uint64_t data_offset() const { return data_offset_; }

  // Metadata in file order.
  const std::vector<std::pair<std::string, GgufValue>>& metadata() const { return kv_; }
  // nullptr when absent.
  const GgufValue* FindValue(absl::string_view key) const;

  // Typed getters: NOT_FOUND when the key is absent, INVALID_ARGUMENT when the
  // value has the wrong type or does not fit.
  absl::StatusOr<absl::string_view> GetString(absl::string_view key) const;
  absl::StatusOr<uint64_t> GetUint64(absl::string_view key) const;
  absl::StatusOr<uint32_t> GetUint32(absl::string_view key) const;
  absl::StatusOr<double> GetDouble(absl::string_view key) const;
  absl::StatusOr<bool> GetBool(absl::string_view key) const;

  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }
  // nullptr when absent.
  const GgufTensorInfo* FindTensor(absl::string_view name) const;
  // NOT_FOUND naming the tensor when absent.
  absl::StatusOr<const GgufTensorInfo*> GetTensor(absl::string_view name) const;

  // Dequantises row `row` (0 <= row < t.num_rows()) of `t` into `dst` (t.ne[0]
  // floats).
  static absl::Status DequantizeTensorRow(const GgufTensorInfo& t, int64_t row, float* dst);

 private:
  friend class GgufParser;
  GgufFile() = default;
  static absl::StatusOr<std::unique_ptr<GgufFile>> Parse(std::unique_ptr<GgufFile> file);

  const uint8_t* base_ = nullptr;
  size_t size_ = 0;
  void* mapping_ = nullptr;  // non-null when mmap'ed
  std::string buffer_;       // owns the bytes for OpenFromBuffer
  uint32_t version_ = 0;
  uint32_t alignment_ = 32;
  uint64_t data_offset_ = 0;
  std::vector<std::pair<std::string, GgufValue>> kv_;
  absl::flat_hash_map<std::string, size_t> kv_index_;
  std::vector<GgufTensorInfo> tensors_;
  absl::flat_hash_map<std::string, size_t> tensor_index_;
};

}  // namespace gguf
}  // namespace kvcache

#endif  // KVCACHE_COMMON_GGUF_GGUF_READER_H_
