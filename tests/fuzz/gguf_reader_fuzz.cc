// libFuzzer harness: arbitrary bytes as a GGUF file. Every accessor on an
// accepted file must stay in bounds; the parser must never crash or allocate
// beyond what the input size allows.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/gguf/gguf_reader.h"
#include "common/gguf/llama_hparams.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using kvcache::gguf::GgufFile;
  auto file = GgufFile::OpenFromBuffer(std::string(reinterpret_cast<const char*>(data), size));
  if (!file.ok()) return 0;
  const GgufFile& f = **file;
  size_t sink = 0;
  for (const auto& [key, value] : f.metadata()) {
    sink += key.size() + value.DebugString().size();
    if (value.is_array()) {
      if (auto s = value.AsStringArray(); s.ok()) sink += s->size();
      if (auto i = value.AsIntArray(); i.ok()) sink += i->size();
      if (auto d = value.AsDoubleArray(); d.ok()) sink += d->size();
    } else {
      (void)value.AsUint64();
      (void)value.AsInt64();
      (void)value.AsDouble();
      (void)value.AsBool();
      if (auto s = value.AsString(); s.ok()) sink += s->size();
    }
  }
  std::vector<float> row;
  for (const auto& t : f.tensors()) {
    if (t.ne[0] > (1 << 16)) continue;
    row.resize(static_cast<size_t>(t.ne[0]));
    (void)GgufFile::DequantizeTensorRow(t, 0, row.data());
    (void)GgufFile::DequantizeTensorRow(t, t.num_rows() - 1, row.data());
  }
  (void)kvcache::gguf::LoadLlamaHparams(f);
  return sink == 0xFFFFFFFF ? 1 : 0;
}
