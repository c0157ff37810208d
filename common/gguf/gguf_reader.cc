#include "common/gguf/gguf_reader.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"

namespace kvcache {
namespace gguf {
namespace {

constexpr char kMagic[4] = {'G', 'G', 'U', 'F'};

// Bytes of one element of a scalar type; 0 for string/array/unknown.
size_t ScalarSize(GgufValueType t) {
  switch (t) {
    case GgufValueType::kUint8:
    case GgufValueType::kInt8:
    case GgufValueType::kBool:
      return 1;
    case GgufValueType::kUint16:
    case GgufValueType::kInt16:
      return 2;
    case GgufValueType::kUint32:
    case GgufValueType::kInt32:
    case GgufValueType::kFloat32:
      return 4;
    case GgufValueType::kUint64:
    case GgufValueType::kInt64:
    case GgufValueType::kFloat64:
      return 8;
    default:
      return 0;
  }
}

bool IsKnownValueType(uint32_t t) { return t <= 12; }

bool IsSignedInt(GgufValueType t) {
  return t == GgufValueType::kInt8 || t == GgufValueType::kInt16 || t == GgufValueType::kInt32 ||
         t == GgufValueType::kInt64;
}
bool IsUnsignedInt(GgufValueType t) {
  return t == GgufValueType::kUint8 || t == GgufValueType::kUint16 || t == GgufValueType::kUint32 ||
         t == GgufValueType::kUint64;
}

// Sign-extends the little-endian payload of an integer of type t.
int64_t SignedFromBits(GgufValueType t, uint64_t bits) {
  switch (t) {
    case GgufValueType::kInt8:
      return static_cast<int8_t>(bits);
    case GgufValueType::kInt16:
      return static_cast<int16_t>(bits);
    case GgufValueType::kInt32:
      return static_cast<int32_t>(bits);
    default:
      return static_cast<int64_t>(bits);
  }
}

uint64_t LoadScalarBits(const uint8_t* p, size_t size) {
  uint64_t v = 0;
  memcpy(&v, p, size);  // little-endian host assumed (x86-64, aarch64)
  return v;
}

double FloatFromBits(GgufValueType t, uint64_t bits) {
  if (t == GgufValueType::kFloat32) {
    float f;
    const uint32_t b = static_cast<uint32_t>(bits);
    memcpy(&f, &b, sizeof(f));
    return f;
  }
  double d;
  memcpy(&d, &bits, sizeof(d));
  return d;
}

}  // namespace

absl::string_view ValueTypeName(GgufValueType type) {
  static constexpr const char* kNames[] = {"uint8",  "int8",    "uint16", "int16",  "uint32",
                                           "int32",  "float32", "bool",   "string", "array",
                                           "uint64", "int64",   "float64"};
  const uint32_t i = static_cast<uint32_t>(type);
  return i < 13 ? kNames[i] : "unknown";
}

// ---- GgufValue ----

absl::StatusOr<uint64_t> GgufValue::AsUint64() const {
  if (IsUnsignedInt(type_)) return bits_;
  if (IsSignedInt(type_)) {
    const int64_t v = SignedFromBits(type_, bits_);
    if (v >= 0) return static_cast<uint64_t>(v);
  }
  return absl::InvalidArgumentError(absl::StrCat("expected a non-negative integer, got ", DebugString()));
}

absl::StatusOr<int64_t> GgufValue::AsInt64() const {
  if (IsSignedInt(type_)) return SignedFromBits(type_, bits_);
  if (IsUnsignedInt(type_) && bits_ <= static_cast<uint64_t>(INT64_MAX)) {
    return static_cast<int64_t>(bits_);
  }
  return absl::InvalidArgumentError(absl::StrCat("expected an integer, got ", DebugString()));
}

absl::StatusOr<double> GgufValue::AsDouble() const {
  if (type_ == GgufValueType::kFloat32 || type_ == GgufValueType::kFloat64) {
    return FloatFromBits(type_, bits_);
  }
  if (IsSignedInt(type_)) return static_cast<double>(SignedFromBits(type_, bits_));
  if (IsUnsignedInt(type_)) return static_cast<double>(bits_);
  return absl::InvalidArgumentError(absl::StrCat("expected a number, got ", DebugString()));
}

absl::StatusOr<bool> GgufValue::AsBool() const {
  if (type_ == GgufValueType::kBool) return bits_ != 0;
  return absl::InvalidArgumentError(absl::StrCat("expected a bool, got ", DebugString()));
}

absl::StatusOr<absl::string_view> GgufValue::AsString() const {
  if (type_ == GgufValueType::kString) return str_;
  return absl::InvalidArgumentError(absl::StrCat("expected a string, got ", DebugString()));
}

absl::StatusOr<std::vector<absl::string_view>> GgufValue::AsStringArray() const {
  if (is_array() && array_type_ == GgufValueType::kString) return strings_;
  return absl::InvalidArgumentError(absl::StrCat("expected an array of strings, got ", DebugString()));
}

absl::StatusOr<std::vector<int64_t>> GgufValue::AsIntArray() const {
  if (!is_array() ||
      !(IsSignedInt(array_type_) || IsUnsignedInt(array_type_) || array_type_ == GgufValueType::kBool)) {
    return absl::InvalidArgumentError(absl::StrCat("expected an array of integers, got ", DebugString()));
  }
  const size_t es = ScalarSize(array_type_);
  std::vector<int64_t> out(array_size_);
  for (uint64_t i = 0; i < array_size_; ++i) {
    const uint64_t bits = LoadScalarBits(array_data_ + i * es, es);
    if (array_type_ == GgufValueType::kUint64 && bits > static_cast<uint64_t>(INT64_MAX)) {
      return absl::InvalidArgumentError("uint64 array element does not fit in int64");
    }
    out[i] = IsSignedInt(array_type_) ? SignedFromBits(array_type_, bits) : static_cast<int64_t>(bits);
  }
  return out;
}

absl::StatusOr<std::vector<double>> GgufValue::AsDoubleArray() const {
  if (!is_array() || ScalarSize(array_type_) == 0 || array_type_ == GgufValueType::kBool) {
    return absl::InvalidArgumentError(absl::StrCat("expected an array of numbers, got ", DebugString()));
  }
  const size_t es = ScalarSize(array_type_);
  std::vector<double> out(array_size_);
  for (uint64_t i = 0; i < array_size_; ++i) {
    const uint64_t bits = LoadScalarBits(array_data_ + i * es, es);
    if (array_type_ == GgufValueType::kFloat32 || array_type_ == GgufValueType::kFloat64) {
      out[i] = FloatFromBits(array_type_, bits);
    } else if (IsSignedInt(array_type_)) {
      out[i] = static_cast<double>(SignedFromBits(array_type_, bits));
    } else {
      out[i] = static_cast<double>(bits);
    }
  }
  return out;
}

std::string GgufValue::DebugString() const {
  switch (type_) {
    case GgufValueType::kString: {
      std::string s(str_.substr(0, 80));
      return absl::StrCat("\"", s, str_.size() > 80 ? "...\"" : "\"");
    }
    case GgufValueType::kBool:
      return bits_ ? "true" : "false";
    case GgufValueType::kFloat32:
    case GgufValueType::kFloat64:
      return absl::StrCat(FloatFromBits(type_, bits_));
    case GgufValueType::kArray:
      return absl::StrCat("array<", ValueTypeName(array_type_), ">[", array_size_, "]");
    default:
      if (IsSignedInt(type_)) return absl::StrCat(SignedFromBits(type_, bits_));
      return absl::StrCat(bits_);
  }
}

std::string GgufTensorInfo::ShapeString() const {
  std::vector<int64_t> dims(ne.begin(), ne.begin() + n_dims);
  return absl::StrCat("[", absl::StrJoin(dims, ", "), "]");
}

// ---- Parser: a bounds-checked cursor over [base, base + size). ----

class GgufParser {
 public:
  GgufParser(GgufFile* file) : f_(file) {}

  absl::Status Run() {
    if (f_->size_ < 4 || memcmp(f_->base_, kMagic, 4) != 0) {
      return Error("not a GGUF file (bad magic)");
    }
    pos_ = 4;
    KVCACHE_RETURN_IF_ERROR(ReadU32(&f_->version_, "version"));
    if (f_->version_ != 2 && f_->version_ != 3) {
      return Error(absl::StrCat("unsupported GGUF version ", f_->version_, " (supported: 2, 3)"));
    }
    uint64_t n_tensors = 0, n_kv = 0;
    KVCACHE_RETURN_IF_ERROR(ReadU64(&n_tensors, "tensor count"));
    KVCACHE_RETURN_IF_ERROR(ReadU64(&n_kv, "metadata count"));
    // Each key/value needs >= 8 (key length) + 4 (type) bytes, each tensor
    // info >= 8 + 4 + 4 + 8 bytes: reject counts the file cannot hold before
    // reserving anything.
    if (n_kv > GgufLimits::kMaxKeyValues || n_kv > Remaining() / 12) {
      return Error(absl::StrCat("metadata count ", n_kv, " is impossible for this file"));
    }
    if (n_tensors > GgufLimits::kMaxTensors || n_tensors > Remaining() / 24) {
      return Error(absl::StrCat("tensor count ", n_tensors, " is impossible for this file"));
    }
    f_->kv_.reserve(n_kv);
    for (uint64_t i = 0; i < n_kv; ++i) {
      KVCACHE_RETURN_IF_ERROR(ReadKeyValue(i));
    }
    if (const GgufValue* a = f_->FindValue("general.alignment")) {
      auto v = a->AsUint64();
      if (!v.ok() || *v == 0 || *v > GgufLimits::kMaxAlignment || (*v & (*v - 1)) != 0) {
        return Error(absl::StrCat("general.alignment must be a power of two <= ", GgufLimits::kMaxAlignment,
                                  ", got ", a->DebugString()));
      }
      f_->alignment_ = static_cast<uint32_t>(*v);
    }
    f_->tensors_.reserve(n_tensors);
    for (uint64_t i = 0; i < n_tensors; ++i) {
      KVCACHE_RETURN_IF_ERROR(ReadTensorInfo(i));
    }
    // The data section starts at the next multiple of the alignment.
    const uint64_t align = f_->alignment_;
    uint64_t data = (pos_ + align - 1) / align * align;
    if (n_tensors > 0 && data > f_->size_) {
      return Error("file truncated before the tensor data section");
    }
    f_->data_offset_ = data;
    const uint64_t data_size = data <= f_->size_ ? f_->size_ - data : 0;
    for (GgufTensorInfo& t : f_->tensors_) {
      if (t.offset % align != 0) {
        return Error(absl::StrCat("tensor '", t.name, "' data offset ", t.offset,
                                  " is not a multiple of the alignment ", align));
      }
      if (t.offset > data_size || static_cast<uint64_t>(t.size_bytes) > data_size - t.offset) {
        return Error(absl::StrCat("tensor '", t.name, "' data [", t.offset, ", +", t.size_bytes,
                                  ") lies past the end of the file (data section is ", data_size,
                                  " bytes; file truncated?)"));
      }
      t.data = f_->base_ + data + t.offset;
    }
    return absl::OkStatus();
  }

 private:
  absl::Status Error(absl::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat("invalid GGUF: ", what));
  }
  uint64_t Remaining() const { return f_->size_ - pos_; }

  absl::Status Need(uint64_t n, absl::string_view what) const {
    if (n > Remaining()) {
      return Error(absl::StrCat("truncated at byte ", pos_, " while reading ", what));
    }
    return absl::OkStatus();
  }

  absl::Status ReadU32(uint32_t* v, absl::string_view what) {
    KVCACHE_RETURN_IF_ERROR(Need(4, what));
    memcpy(v, f_->base_ + pos_, 4);
    pos_ += 4;
    return absl::OkStatus();
  }
  absl::Status ReadU64(uint64_t* v, absl::string_view what) {
    KVCACHE_RETURN_IF_ERROR(Need(8, what));
    memcpy(v, f_->base_ + pos_, 8);
    pos_ += 8;
    return absl::OkStatus();
  }
  absl::Status ReadString(absl::string_view* s, absl::string_view what) {
    uint64_t len = 0;
    KVCACHE_RETURN_IF_ERROR(ReadU64(&len, what));
    if (len > GgufLimits::kMaxStringBytes) {
      return Error(absl::StrCat(what, " has length ", len, " (limit ", GgufLimits::kMaxStringBytes, ")"));
    }
    KVCACHE_RETURN_IF_ERROR(Need(len, what));
    *s = absl::string_view(reinterpret_cast<const char*>(f_->base_ + pos_), len);
    pos_ += len;
    return absl::OkStatus();
  }

  absl::Status ReadValue(GgufValueType type, GgufValue* v, absl::string_view key) {
    v->type_ = type;
    if (type == GgufValueType::kString) {
      return ReadString(&v->str_, absl::StrCat("string value of '", key, "'"));
    }
    if (type == GgufValueType::kArray) {
      uint32_t et = 0;
      KVCACHE_RETURN_IF_ERROR(ReadU32(&et, "array type"));
      if (!IsKnownValueType(et)) {
        return Error(absl::StrCat("key '", key, "' has unknown array element type ", et));
      }
      if (et == static_cast<uint32_t>(GgufValueType::kArray)) {
        return Error(absl::StrCat("key '", key, "' is a nested array (unsupported)"));
      }
      uint64_t n = 0;
      KVCACHE_RETURN_IF_ERROR(ReadU64(&n, "array length"));
      v->array_type_ = static_cast<GgufValueType>(et);
      const size_t es = ScalarSize(v->array_type_);
      const uint64_t min_elem = es == 0 ? 8 : es;  // a string needs its 8-byte length
      if (n > GgufLimits::kMaxArrayElements || n > Remaining() / min_elem) {
        return Error(absl::StrCat("key '", key, "' array of ", n, " elements does not fit in the file"));
      }
      v->array_size_ = n;
      if (es != 0) {
        v->array_data_ = f_->base_ + pos_;
        pos_ += n * es;
        if (v->array_type_ == GgufValueType::kBool) {
          for (uint64_t i = 0; i < n; ++i) {
            if (v->array_data_[i] > 1) {
              return Error(absl::StrCat("key '", key, "' has a bool that is not 0 or 1"));
            }
          }
        }
        return absl::OkStatus();
      }
      v->strings_.resize(n);
      for (uint64_t i = 0; i < n; ++i) {
        KVCACHE_RETURN_IF_ERROR(ReadString(&v->strings_[i], absl::StrCat("element ", i, " of '", key, "'")));
      }
      return absl::OkStatus();
    }
    const size_t es = ScalarSize(type);
    KVCACHE_RETURN_IF_ERROR(Need(es, absl::StrCat("value of '", key, "'")));
    v->bits_ = LoadScalarBits(f_->base_ + pos_, es);
    pos_ += es;
    if (type == GgufValueType::kBool && v->bits_ > 1) {
      return Error(absl::StrCat("key '", key, "' has a bool that is not 0 or 1"));
    }
    return absl::OkStatus();
  }

  absl::Status ReadKeyValue(uint64_t i) {
    absl::string_view key;
    KVCACHE_RETURN_IF_ERROR(ReadString(&key, absl::StrCat("key ", i)));
    if (key.empty()) return Error(absl::StrCat("metadata key ", i, " is empty"));
    uint32_t type = 0;
    KVCACHE_RETURN_IF_ERROR(ReadU32(&type, "value type"));
    if (!IsKnownValueType(type)) {
      return Error(absl::StrCat("key '", key, "' has unknown value type ", type));
    }
    GgufValue v;
    KVCACHE_RETURN_IF_ERROR(ReadValue(static_cast<GgufValueType>(type), &v, key));
    std::string k(key);
    if (!f_->kv_index_.emplace(k, f_->kv_.size()).second) {
      return Error(absl::StrCat("duplicate metadata key '", key, "'"));
    }
    f_->kv_.emplace_back(std::move(k), std::move(v));
    return absl::OkStatus();
  }

  absl::Status ReadTensorInfo(uint64_t i) {
    absl::string_view name;
    KVCACHE_RETURN_IF_ERROR(ReadString(&name, absl::StrCat("name of tensor ", i)));
    if (name.empty() || name.size() > GgufLimits::kMaxTensorName) {
      return Error(absl::StrCat("tensor ", i, " name length ", name.size(), " is outside [1, ",
                                GgufLimits::kMaxTensorName, "]"));
    }
    GgufTensorInfo t;
    t.name = std::string(name);
    uint32_t n_dims = 0;
    KVCACHE_RETURN_IF_ERROR(ReadU32(&n_dims, "tensor dimension count"));
    if (n_dims == 0 || n_dims > GgufLimits::kMaxDims) {
      return Error(absl::StrCat("tensor '", t.name, "' has ", n_dims, " dimensions (must be 1..",
                                GgufLimits::kMaxDims, ")"));
    }
    t.n_dims = static_cast<int>(n_dims);
    int64_t elements = 1;
    for (uint32_t d = 0; d < n_dims; ++d) {
      uint64_t ne = 0;
      KVCACHE_RETURN_IF_ERROR(ReadU64(&ne, "tensor dimension"));
      if (ne == 0 || ne > static_cast<uint64_t>(INT64_MAX) ||
          static_cast<int64_t>(ne) > INT64_MAX / elements) {
        return Error(absl::StrCat("tensor '", t.name, "' dimension ", d, " = ", ne, " is zero or overflows"));
      }
      t.ne[d] = static_cast<int64_t>(ne);
      elements *= t.ne[d];
    }
    uint32_t type = 0;
    KVCACHE_RETURN_IF_ERROR(ReadU32(&type, "tensor type"));
    const GgmlTypeTraits* traits = GetTypeTraits(type);
    if (traits == nullptr) {
      return Error(absl::StrCat("tensor '", t.name, "' has unknown ggml type ", type));
    }
    t.type = static_cast<GgmlType>(type);
    KVCACHE_RETURN_IF_ERROR(ReadU64(&t.offset, "tensor offset"));
    auto row = RowBytes(t.type, t.ne[0]);
    if (!row.ok()) {
      return Error(absl::StrCat("tensor '", t.name, "': ", row.status().message()));
    }
    t.row_bytes = *row;
    const int64_t rows = t.num_rows();
    if (t.row_bytes != 0 && rows > INT64_MAX / t.row_bytes) {
      return Error(absl::StrCat("tensor '", t.name, "' byte size overflows"));
    }
    t.size_bytes = t.row_bytes * rows;
    if (!f_->tensor_index_.emplace(t.name, f_->tensors_.size()).second) {
      return Error(absl::StrCat("duplicate tensor name '", t.name, "'"));
    }
    f_->tensors_.push_back(std::move(t));
    return absl::OkStatus();
  }

  GgufFile* f_;
  uint64_t pos_ = 0;
};

// ---- GgufFile ----

GgufFile::~GgufFile() {
  if (mapping_ != nullptr) munmap(mapping_, size_);
}

absl::StatusOr<std::unique_ptr<GgufFile>> GgufFile::Open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    const std::string msg = absl::StrCat("cannot open GGUF file ", path, ": ", strerror(err));
    return err == ENOENT ? absl::NotFoundError(msg) : absl::PermissionDeniedError(msg);
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(path, " is not a regular file"));
  }
  std::unique_ptr<GgufFile> file(new GgufFile());
  file->size_ = static_cast<size_t>(st.st_size);
  if (file->size_ > 0) {
    void* m = mmap(nullptr, file->size_, PROT_READ, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      return absl::InternalError(absl::StrCat("mmap ", path, ": ", strerror(err)));
    }
    file->mapping_ = m;
    file->base_ = static_cast<const uint8_t*>(m);
  }
  ::close(fd);
  auto parsed = Parse(std::move(file));
  if (!parsed.ok()) {
    return absl::Status(parsed.status().code(), absl::StrCat(path, ": ", parsed.status().message()));
  }
  return parsed;
}

absl::StatusOr<std::unique_ptr<GgufFile>> GgufFile::OpenFromBuffer(std::string bytes) {
  std::unique_ptr<GgufFile> file(new GgufFile());
  file->buffer_ = std::move(bytes);
  file->base_ = reinterpret_cast<const uint8_t*>(file->buffer_.data());
  file->size_ = file->buffer_.size();
  return Parse(std::move(file));
}

absl::StatusOr<std::unique_ptr<GgufFile>> GgufFile::Parse(std::unique_ptr<GgufFile> file) {
  GgufParser parser(file.get());
  KVCACHE_RETURN_IF_ERROR(parser.Run());
  return file;
}

const GgufValue* GgufFile::FindValue(absl::string_view key) const {
  auto it = kv_index_.find(key);
  return it == kv_index_.end() ? nullptr : &kv_[it->second].second;
}

namespace {
absl::Status KeyError(absl::string_view key, const absl::Status& s) {
  return absl::Status(s.code(), absl::StrCat("metadata '", key, "': ", s.message()));
}
}  // namespace

absl::StatusOr<absl::string_view> GgufFile::GetString(absl::string_view key) const {
  const GgufValue* v = FindValue(key);
  if (v == nullptr) return absl::NotFoundError(absl::StrCat("metadata '", key, "' is missing"));
  auto r = v->AsString();
  if (!r.ok()) return KeyError(key, r.status());
  return r;
}

absl::StatusOr<uint64_t> GgufFile::GetUint64(absl::string_view key) const {
  const GgufValue* v = FindValue(key);
  if (v == nullptr) return absl::NotFoundError(absl::StrCat("metadata '", key, "' is missing"));
  auto r = v->AsUint64();
  if (!r.ok()) return KeyError(key, r.status());
  return r;
}

absl::StatusOr<uint32_t> GgufFile::GetUint32(absl::string_view key) const {
  KVCACHE_ASSIGN_OR_RETURN(uint64_t v, GetUint64(key));
  if (v > std::numeric_limits<uint32_t>::max()) {
    return absl::InvalidArgumentError(absl::StrCat("metadata '", key, "' = ", v, " does not fit in 32 bits"));
  }
  return static_cast<uint32_t>(v);
}

absl::StatusOr<double> GgufFile::GetDouble(absl::string_view key) const {
  const GgufValue* v = FindValue(key);
  if (v == nullptr) return absl::NotFoundError(absl::StrCat("metadata '", key, "' is missing"));
  auto r = v->AsDouble();
  if (!r.ok()) return KeyError(key, r.status());
  return r;
}

absl::StatusOr<bool> GgufFile::GetBool(absl::string_view key) const {
  const GgufValue* v = FindValue(key);
  if (v == nullptr) return absl::NotFoundError(absl::StrCat("metadata '", key, "' is missing"));
  auto r = v->AsBool();
  if (!r.ok()) return KeyError(key, r.status());
  return r;
}

const GgufTensorInfo* GgufFile::FindTensor(absl::string_view name) const {
  auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

absl::StatusOr<const GgufTensorInfo*> GgufFile::GetTensor(absl::string_view name) const {
  const GgufTensorInfo* t = FindTensor(name);
  if (t == nullptr) return absl::NotFoundError(absl::StrCat("tensor '", name, "' not found"));
  return t;
}

absl::Status GgufFile::DequantizeTensorRow(const GgufTensorInfo& t, int64_t row, float* dst) {
  if (row < 0 || row >= t.num_rows()) {
    return absl::OutOfRangeError(
        absl::StrCat("row ", row, " of tensor '", t.name, "' with ", t.num_rows(), " rows"));
  }
  return DequantizeRow(t.type, t.data + row * t.row_bytes, dst, t.ne[0]);
}

}  // namespace gguf
}  // namespace kvcache
