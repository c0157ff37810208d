// kvcache-tiny-model: writes the tiny reference models (one per supported
// architecture feature, gguf::ArchitectureReferenceModels) as OUT_DIR/NAME.gguf,
// for tests/data/record_arch_reference.py to run through llama.cpp.
#include <cstdio>
#include <memory>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "common/flags_usage.h"
#include "common/gguf/tiny_llama.h"

ABSL_FLAG(std::string, out_dir, "", "Folder to write NAME.gguf into (must exist).");
ABSL_FLAG(std::string, llamacpp_src, "",
          "llama.cpp source folder whose models/ggml-vocab-*.gguf give the real vocabularies.");

int main(int argc, char** argv) {
  kvcache::SetFlagsUsage("Writes the tiny reference models: kvcache-tiny-model --out_dir=DIR");
  absl::ParseCommandLine(argc, argv);
  const std::string dir = absl::GetFlag(FLAGS_out_dir);
  if (dir.empty()) {
    std::fprintf(stderr, "--out_dir is required\n");
    return 2;
  }
  for (auto m : kvcache::gguf::ArchitectureReferenceModels()) {
    const std::string path = dir + "/" + m.name + ".gguf";
    std::unique_ptr<kvcache::gguf::GgufFile> vocab;
    if (!m.vocab.empty()) {
      const std::string vocab_path =
          absl::GetFlag(FLAGS_llamacpp_src) + "/models/ggml-vocab-" + m.vocab + ".gguf";
      auto f = kvcache::gguf::GgufFile::Open(vocab_path);
      if (!f.ok()) {
        std::fprintf(stderr, "%s: %s (set --llamacpp_src)\n", vocab_path.c_str(),
                     f.status().ToString().c_str());
        return 1;
      }
      vocab = std::move(*f);
      m.options.vocab = vocab.get();
    }
    absl::Status st = kvcache::gguf::WriteTinyLlama(m.options, path);
    if (!st.ok()) {
      std::fprintf(stderr, "%s: %s\n", path.c_str(), st.ToString().c_str());
      return 1;
    }
    std::printf("%s\n", path.c_str());
  }
  return 0;
}
