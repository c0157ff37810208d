// Builds GGUF files (version 3) in memory: metadata, tensor infos and aligned
// tensor data. Used by tests to make small models and by the fuzz corpus.
//
//   GgufWriter w;
//   w.AddString("general.architecture", "llama");
//   KVCACHE_RETURN_IF_ERROR(w.AddTensorFromFloats("x", GgmlType::kQ8_0, {64, 2}, values));
//   KVCACHE_RETURN_IF_ERROR(w.WriteToFile(path));
//
// Thread-safety: not thread-safe; one writer per thread.
#ifndef KVCACHE_COMMON_GGUF_GGUF_WRITER_H_
#define KVCACHE_COMMON_GGUF_GGUF_WRITER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "common/gguf/ggml_types.h"
#include "common/gguf/gguf_reader.h"

namespace kvcache {
namespace gguf {

class GgufWriter {
 public:
  // REQUIRES: alignment is a power of two. A non-default alignment is written
  // as `general.alignment`.
  explicit GgufWriter(uint32_t alignment = 32);

  // Metadata, written in call order. Keys must be unique (checked by Serialize).
  void AddUint8(absl::string_view key, uint8_t v);
  void AddInt32(absl::string_view key, int32_t v);
  void AddUint32(absl::string_view key, uint32_t v);
  void AddUint64(absl::string_view key, uint64_t v);
  void AddFloat32(absl::string_view key, float v);
  void AddFloat64(absl::string_view key, double v);
  void AddBool(absl::string_view key, bool v);
  void AddString(absl::string_view key, absl::string_view v);
  void AddStringArray(absl::string_view key, const std::vector<std::string>& v);
  void AddInt32Array(absl::string_view key, const std::vector<int32_t>& v);
  void AddFloat32Array(absl::string_view key, const std::vector<float>& v);
  // A value read from another file, with its type: scalars of every type, and
  // arrays of strings, int32, uint32 or float32 (what tokenizer metadata holds).
  // UNIMPLEMENTED for other array types (nothing is written then).
  absl::Status CopyValue(absl::string_view key, const GgufValue& v);

  // A tensor from already encoded bytes. `shape` is in ggml order (ne[0]
  // first), 1..4 dims. INVALID_ARGUMENT when data.size() does not match.
  absl::Status AddTensor(absl::string_view name, GgmlType type, const std::vector<int64_t>& shape,
                         std::string data);
  // A tensor quantised from floats (row-major, ne[0] contiguous) with QuantizeRow.
  absl::Status AddTensorFromFloats(absl::string_view name, GgmlType type, const std::vector<int64_t>& shape,
                                   const std::vector<float>& values);

  // The whole file. INVALID_ARGUMENT on duplicate keys or tensor names.
  absl::StatusOr<std::string> Serialize() const;
  absl::Status WriteToFile(const std::string& path) const;

 private:
  struct Tensor {
    std::string name;
    GgmlType type;
    std::vector<int64_t> shape;
    std::string data;
  };
  void AddKey(absl::string_view key, GgufValueType type);

  uint32_t alignment_;
  uint64_t n_kv_ = 0;
  std::vector<std::string> keys_;
  std::string kv_bytes_;
  std::vector<Tensor> tensors_;
};

}  // namespace gguf
}  // namespace kvcache

#endif  // KVCACHE_COMMON_GGUF_GGUF_WRITER_H_
