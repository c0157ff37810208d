#include "worker/backend/backend_loader.h"

#include <dlfcn.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace kvcache::backend {
namespace {

std::string ExecutableDir() {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return "";
  std::string path(buf, static_cast<size_t>(n));
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "" : path.substr(0, slash);
}

bool FileExists(const std::string& path) { return access(path.c_str(), F_OK) == 0; }

}  // namespace

std::string DeviceSpec::ToString() const { return kind == Kind::kCpu ? "cpu" : absl::StrCat("cuda:", index); }

absl::StatusOr<DeviceSpec> ParseDevice(const std::string& text) {
  DeviceSpec spec;
  if (text == "cpu") return spec;
  if (text == "cuda") {
    spec.kind = DeviceSpec::Kind::kCuda;
    return spec;
  }
  int index = -1;
  if (absl::StartsWith(text, "cuda:") && absl::SimpleAtoi(text.substr(5), &index) && index >= 0 &&
      text.size() > 5 && text[5] != '+' && text[5] != '-') {
    spec.kind = DeviceSpec::Kind::kCuda;
    spec.index = index;
    return spec;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--device=", text, ": expected cpu, cuda or cuda:N (N >= 0)"));
}

std::vector<std::string> CudaPluginCandidates(const std::string& flag_path) {
  if (!flag_path.empty()) return {flag_path};
  std::vector<std::string> out;
  const std::string exe_dir = ExecutableDir();
  if (!exe_dir.empty()) out.push_back(absl::StrCat(exe_dir, "/", kCudaPluginFileName));
  if (const char* build = std::getenv("KVCACHE_BUILD_DIR"); build != nullptr && *build != '\0') {
    out.push_back(absl::StrCat(build, "/worker/", kCudaPluginFileName));
    out.push_back(absl::StrCat(build, "/", kCudaPluginFileName));
  }
  return out;
}

absl::StatusOr<std::unique_ptr<CudaBackend>> LoadCudaBackend(const DeviceSpec& device,
                                                             const std::string& flag_path) {
  if (device.kind != DeviceSpec::Kind::kCuda) {
    return absl::InvalidArgumentError(
        absl::StrCat("LoadCudaBackend: device ", device.ToString(), " is not CUDA"));
  }
  const std::vector<std::string> candidates = CudaPluginCandidates(flag_path);
  std::string path;
  for (const std::string& c : candidates) {
    if (FileExists(c)) {
      path = c;
      break;
    }
  }
  if (path.empty()) {
    return absl::NotFoundError(
        absl::StrCat("--device=", device.ToString(), ": CUDA backend plugin ", kCudaPluginFileName,
                     " not found (looked at ",
                     candidates.empty() ? std::string("nothing") : absl::StrJoin(candidates, ", "),
                     "); build kvcache with the CUDA toolkit installed (nvcc) or pass --cuda_plugin=PATH"));
  }
  // RTLD_LOCAL: the plugin's symbols (its own copies of project libraries) stay
  // private. Never dlclose'd: CUDA and cuBLAS do not support being unloaded.
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* err = dlerror();
    return absl::FailedPreconditionError(absl::StrCat("cannot load CUDA backend plugin ", path, ": ",
                                                      err != nullptr ? err : "unknown dlopen error"));
  }
  auto entry = reinterpret_cast<CudaBackendEntryFn>(dlsym(handle, kCudaBackendEntryPoint));
  if (entry == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat("CUDA backend plugin ", path, " has no ",
                                                      kCudaBackendEntryPoint, " (not a kvcache plugin?)"));
  }
  CudaBackendFactory* factory = entry();
  if (factory == nullptr || factory->abi_version() != kCudaBackendAbiVersion) {
    return absl::FailedPreconditionError(absl::StrCat(
        "CUDA backend plugin ", path, " has ABI version ", factory == nullptr ? -1 : factory->abi_version(),
        "; this worker needs ", kCudaBackendAbiVersion, " (rebuild both from one tree)"));
  }
  CudaBackendOptions options;
  options.device = device.index;
  return factory->Create(options);
}

}  // namespace kvcache::backend
