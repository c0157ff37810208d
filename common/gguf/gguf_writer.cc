#include "common/gguf/gguf_writer.h"

#include <cstdio>
#include <cstring>
#include <memory>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace kvcache {
namespace gguf {
namespace {

template <typename T>
void Put(std::string* out, T v) {
  char buf[sizeof(T)];
  memcpy(buf, &v, sizeof(T));
  out->append(buf, sizeof(T));
}

void PutString(std::string* out, absl::string_view s) {
  Put<uint64_t>(out, s.size());
  out->append(s.data(), s.size());
}

}  // namespace

GgufWriter::GgufWriter(uint32_t alignment) : alignment_(alignment) {
  if (alignment_ != 32) AddUint32("general.alignment", alignment_);
}

void GgufWriter::AddKey(absl::string_view key, GgufValueType type) {
  keys_.emplace_back(key);
  ++n_kv_;
  PutString(&kv_bytes_, key);
  Put<uint32_t>(&kv_bytes_, static_cast<uint32_t>(type));
}

void GgufWriter::AddUint8(absl::string_view key, uint8_t v) {
  AddKey(key, GgufValueType::kUint8);
  Put(&kv_bytes_, v);
}
void GgufWriter::AddInt32(absl::string_view key, int32_t v) {
  AddKey(key, GgufValueType::kInt32);
  Put(&kv_bytes_, v);
}
void GgufWriter::AddUint32(absl::string_view key, uint32_t v) {
  AddKey(key, GgufValueType::kUint32);
  Put(&kv_bytes_, v);
}
void GgufWriter::AddUint64(absl::string_view key, uint64_t v) {
  AddKey(key, GgufValueType::kUint64);
  Put(&kv_bytes_, v);
}
void GgufWriter::AddFloat32(absl::string_view key, float v) {
  AddKey(key, GgufValueType::kFloat32);
  Put(&kv_bytes_, v);
}
void GgufWriter::AddFloat64(absl::string_view key, double v) {
  AddKey(key, GgufValueType::kFloat64);
  Put(&kv_bytes_, v);
}
void GgufWriter::AddBool(absl::string_view key, bool v) {
  AddKey(key, GgufValueType::kBool);
  Put<uint8_t>(&kv_bytes_, v ? 1 : 0);
}
void GgufWriter::AddString(absl::string_view key, absl::string_view v) {
  AddKey(key, GgufValueType::kString);
  PutString(&kv_bytes_, v);
}
void GgufWriter::AddStringArray(absl::string_view key, const std::vector<std::string>& v) {
  AddKey(key, GgufValueType::kArray);
  Put<uint32_t>(&kv_bytes_, static_cast<uint32_t>(GgufValueType::kString));
  Put<uint64_t>(&kv_bytes_, v.size());
  for (const std::string& s : v) PutString(&kv_bytes_, s);
}
void GgufWriter::AddInt32Array(absl::string_view key, const std::vector<int32_t>& v) {
  AddKey(key, GgufValueType::kArray);
  Put<uint32_t>(&kv_bytes_, static_cast<uint32_t>(GgufValueType::kInt32));
  Put<uint64_t>(&kv_bytes_, v.size());
  for (int32_t x : v) Put(&kv_bytes_, x);
}
void GgufWriter::AddFloat32Array(absl::string_view key, const std::vector<float>& v) {
  AddKey(key, GgufValueType::kArray);
  Put<uint32_t>(&kv_bytes_, static_cast<uint32_t>(GgufValueType::kFloat32));
  Put<uint64_t>(&kv_bytes_, v.size());
  for (float x : v) Put(&kv_bytes_, x);
}

absl::Status GgufWriter::CopyValue(absl::string_view key, const GgufValue& v) {
  switch (v.type()) {
    case GgufValueType::kString: {
      KVCACHE_ASSIGN_OR_RETURN(absl::string_view s, v.AsString());
      AddString(key, s);
      return absl::OkStatus();
    }
    case GgufValueType::kBool: {
      KVCACHE_ASSIGN_OR_RETURN(bool b, v.AsBool());
      AddBool(key, b);
      return absl::OkStatus();
    }
    case GgufValueType::kFloat32:
    case GgufValueType::kFloat64: {
      KVCACHE_ASSIGN_OR_RETURN(double d, v.AsDouble());
      if (v.type() == GgufValueType::kFloat32) {
        AddFloat32(key, static_cast<float>(d));
      } else {
        AddFloat64(key, d);
      }
      return absl::OkStatus();
    }
    case GgufValueType::kArray:
      break;
    default: {  // integers
      KVCACHE_ASSIGN_OR_RETURN(int64_t i, v.AsInt64());
      if (v.type() == GgufValueType::kUint32) {
        AddUint32(key, static_cast<uint32_t>(i));
      } else if (v.type() == GgufValueType::kInt32) {
        AddInt32(key, static_cast<int32_t>(i));
      } else if (v.type() == GgufValueType::kUint8) {
        AddUint8(key, static_cast<uint8_t>(i));
      } else {
        AddUint64(key, static_cast<uint64_t>(i));
      }
      return absl::OkStatus();
    }
  }
  switch (v.array_type()) {
    case GgufValueType::kString: {
      KVCACHE_ASSIGN_OR_RETURN(std::vector<absl::string_view> a, v.AsStringArray());
      AddStringArray(key, std::vector<std::string>(a.begin(), a.end()));
      return absl::OkStatus();
    }
    case GgufValueType::kInt32:
    case GgufValueType::kUint32: {
      KVCACHE_ASSIGN_OR_RETURN(std::vector<int64_t> a, v.AsIntArray());
      AddKey(key, GgufValueType::kArray);
      Put<uint32_t>(&kv_bytes_, static_cast<uint32_t>(v.array_type()));
      Put<uint64_t>(&kv_bytes_, a.size());
      for (int64_t x : a) Put<uint32_t>(&kv_bytes_, static_cast<uint32_t>(x));  // the same 4 bytes either way
      return absl::OkStatus();
    }
    case GgufValueType::kFloat32: {
      KVCACHE_ASSIGN_OR_RETURN(std::vector<double> a, v.AsDoubleArray());
      AddFloat32Array(key, std::vector<float>(a.begin(), a.end()));
      return absl::OkStatus();
    }
    default:
      return absl::UnimplementedError(absl::StrCat("cannot copy array '", key, "' of element type ",
                                                   static_cast<uint32_t>(v.array_type())));
  }
}

absl::Status GgufWriter::AddTensor(absl::string_view name, GgmlType type, const std::vector<int64_t>& shape,
                                   std::string data) {
  if (shape.empty() || shape.size() > GgufLimits::kMaxDims) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "' needs 1..4 dims"));
  }
  KVCACHE_ASSIGN_OR_RETURN(int64_t row, RowBytes(type, shape[0]));
  int64_t rows = 1;
  for (size_t i = 1; i < shape.size(); ++i) {
    if (shape[i] <= 0) return absl::InvalidArgumentError("tensor dims must be positive");
    rows *= shape[i];
  }
  if (static_cast<int64_t>(data.size()) != row * rows) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", name, "' has ", data.size(), " bytes, shape needs ", row * rows));
  }
  tensors_.push_back(Tensor{std::string(name), type, shape, std::move(data)});
  return absl::OkStatus();
}

absl::Status GgufWriter::AddTensorFromFloats(absl::string_view name, GgmlType type,
                                             const std::vector<int64_t>& shape,
                                             const std::vector<float>& values) {
  if (shape.empty() || shape[0] <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "' has a bad shape"));
  }
  KVCACHE_ASSIGN_OR_RETURN(int64_t row, RowBytes(type, shape[0]));
  const int64_t rows = static_cast<int64_t>(values.size()) / shape[0];
  if (rows * shape[0] != static_cast<int64_t>(values.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", name, "': ", values.size(), " values is not whole rows"));
  }
  std::string data(static_cast<size_t>(row * rows), '\0');
  for (int64_t r = 0; r < rows; ++r) {
    KVCACHE_RETURN_IF_ERROR(QuantizeRow(type, values.data() + r * shape[0], &data[r * row], shape[0]));
  }
  return AddTensor(name, type, shape, std::move(data));
}

absl::StatusOr<std::string> GgufWriter::Serialize() const {
  absl::flat_hash_set<std::string> seen;
  for (const std::string& k : keys_) {
    if (!seen.insert(k).second) {
      return absl::InvalidArgumentError(absl::StrCat("duplicate metadata key '", k, "'"));
    }
  }
  seen.clear();
  std::string out = "GGUF";
  Put<uint32_t>(&out, 3);
  Put<uint64_t>(&out, tensors_.size());
  Put<uint64_t>(&out, n_kv_);
  out += kv_bytes_;
  uint64_t offset = 0;
  std::vector<uint64_t> offsets;
  for (const Tensor& t : tensors_) {
    if (!seen.insert(t.name).second) {
      return absl::InvalidArgumentError(absl::StrCat("duplicate tensor '", t.name, "'"));
    }
    PutString(&out, t.name);
    Put<uint32_t>(&out, static_cast<uint32_t>(t.shape.size()));
    for (int64_t d : t.shape) Put<uint64_t>(&out, static_cast<uint64_t>(d));
    Put<uint32_t>(&out, static_cast<uint32_t>(t.type));
    Put<uint64_t>(&out, offset);
    offsets.push_back(offset);
    offset += (t.data.size() + alignment_ - 1) / alignment_ * alignment_;
  }
  out.resize((out.size() + alignment_ - 1) / alignment_ * alignment_, '\0');
  const size_t data_start = out.size();
  for (size_t i = 0; i < tensors_.size(); ++i) {
    out.resize(data_start + offsets[i], '\0');
    out += tensors_[i].data;
  }
  if (!tensors_.empty()) out.resize(data_start + offset, '\0');
  return out;
}

absl::Status GgufWriter::WriteToFile(const std::string& path) const {
  KVCACHE_ASSIGN_OR_RETURN(std::string bytes, Serialize());
  std::unique_ptr<FILE, int (*)(FILE*)> f(fopen(path.c_str(), "wb"), fclose);
  if (f == nullptr) return absl::PermissionDeniedError(absl::StrCat("cannot write ", path));
  if (fwrite(bytes.data(), 1, bytes.size(), f.get()) != bytes.size()) {
    return absl::DataLossError(absl::StrCat("short write to ", path));
  }
  return absl::OkStatus();
}

}  // namespace gguf
}  // namespace kvcache
