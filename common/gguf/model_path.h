// Where the default model lives, and opening a model file with an error that
// tells the operator how to get it.
//
// Thread-safety: free functions; DefaultModelPath reads the environment.
#ifndef KVCACHE_COMMON_GGUF_MODEL_PATH_H_
#define KVCACHE_COMMON_GGUF_MODEL_PATH_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/gguf/gguf_reader.h"

namespace kvcache {
namespace gguf {

// $KVCACHE_MODEL when set and non-empty, else
// $HOME/.cache/kvcache/models/SmolLM2-135M-Instruct.Q4_1.gguf.
std::string DefaultModelPath();

// GgufFile::Open, except that a missing file is NOT_FOUND with a message
// naming the set-up command (scripts/setup.sh) that fetches the model.
absl::StatusOr<std::unique_ptr<GgufFile>> OpenModelFile(const std::string& path);

}  // namespace gguf
}  // namespace kvcache

#endif  // KVCACHE_COMMON_GGUF_MODEL_PATH_H_
