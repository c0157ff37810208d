#include "worker/backend/cuda/device_context.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "worker/backend/cuda/cuda_check.h"
#include "worker/backend/cuda/page_copy.h"

namespace kvcache::cuda {

absl::StatusOr<std::shared_ptr<DeviceContext>> DeviceContext::Create(int device) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear
    return absl::UnavailableError(
        absl::StrCat("no CUDA device: ", cudaGetErrorName(err), ": ", cudaGetErrorString(err),
                     " (is the NVIDIA driver installed? use --device=cpu otherwise)"));
  }
  if (count == 0) return absl::UnavailableError("no CUDA device: the driver reports 0 devices");
  if (device < 0 || device >= count) {
    return absl::InvalidArgumentError(
        absl::StrCat("--device=cuda:", device, " is out of range: ", count, " CUDA device(s) present"));
  }
  std::shared_ptr<DeviceContext> ctx(new DeviceContext());
  ctx->device_ = device;
  KVCACHE_CUDA_RETURN_IF_ERROR(cudaSetDevice(device), "cudaSetDevice");
  cudaDeviceProp prop{};
  KVCACHE_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  ctx->name_ = prop.name;
  ctx->cc_major_ = prop.major;
  ctx->cc_minor_ = prop.minor;
  ctx->total_bytes_ = static_cast<int64_t>(prop.totalGlobalMem);
  KVCACHE_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&ctx->compute_, cudaStreamNonBlocking),
                               "create compute stream");
  KVCACHE_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&ctx->copy_, cudaStreamNonBlocking),
                               "create copy stream");
  KVCACHE_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&ctx->compute_mark_, cudaEventDisableTiming),
                               "create event");
  KVCACHE_CUBLAS_RETURN_IF_ERROR(cublasCreate(&ctx->cublas_), "cublasCreate");
  KVCACHE_CUBLAS_RETURN_IF_ERROR(cublasSetStream(ctx->cublas_, ctx->compute_), "cublasSetStream");
  // Load the page copy kernel now (lazy module loading would take device memory
  // at the first offload instead).
  KVCACHE_RETURN_IF_ERROR(LoadPageCopyKernel());
  return ctx;
}

DeviceContext::~DeviceContext() {
  // Errors here cannot be reported; the process may be shutting down the driver.
  cudaSetDevice(device_);
  if (cublas_ != nullptr) cublasDestroy(cublas_);
  if (compute_mark_ != nullptr) cudaEventDestroy(compute_mark_);
  if (copy_ != nullptr) cudaStreamDestroy(copy_);
  if (compute_ != nullptr) cudaStreamDestroy(compute_);
}

absl::Status DeviceContext::Activate() const { return CudaStatus(cudaSetDevice(device_), "cudaSetDevice"); }

absl::Status DeviceContext::CopyAfterCompute() const {
  KVCACHE_CUDA_RETURN_IF_ERROR(cudaEventRecord(compute_mark_, compute_), "record compute event");
  return CudaStatus(cudaStreamWaitEvent(copy_, compute_mark_, 0), "copy stream waits for compute");
}

absl::Status DeviceContext::SyncCopy(absl::string_view what) const {
  return CudaStatus(cudaStreamSynchronize(copy_), what);
}

std::string DeviceContext::Describe() const {
  return absl::StrFormat("cuda:%d (%s, %.1f GiB, sm_%d%d)", device_, name_,
                         static_cast<double>(total_bytes_) / (1 << 30), cc_major_, cc_minor_);
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    Reset();
    ptr_ = o.ptr_;
    bytes_ = o.bytes_;
    o.ptr_ = nullptr;
    o.bytes_ = 0;
  }
  return *this;
}

absl::StatusOr<DeviceBuffer> DeviceBuffer::Allocate(int64_t bytes, absl::string_view what) {
  DeviceBuffer b;
  if (bytes <= 0) return b;
  const cudaError_t err = cudaMalloc(&b.ptr_, static_cast<size_t>(bytes));
  if (err != cudaSuccess) {
    cudaGetLastError();
    size_t free_bytes = 0, total = 0;
    cudaMemGetInfo(&free_bytes, &total);
    return CudaStatus(err, absl::StrFormat("cudaMalloc of %d bytes for %s (device has %d of %d bytes free)",
                                           bytes, what, free_bytes, total));
  }
  b.bytes_ = bytes;
  return b;
}

void DeviceBuffer::Reset() {
  if (ptr_ != nullptr) cudaFree(ptr_);
  ptr_ = nullptr;
  bytes_ = 0;
}

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& o) noexcept {
  if (this != &o) {
    Reset();
    ptr_ = o.ptr_;
    bytes_ = o.bytes_;
    o.ptr_ = nullptr;
    o.bytes_ = 0;
  }
  return *this;
}

absl::StatusOr<PinnedBuffer> PinnedBuffer::Allocate(int64_t bytes, absl::string_view what) {
  PinnedBuffer b;
  if (bytes <= 0) return b;
  const cudaError_t err =
      cudaHostAlloc(&b.ptr_, static_cast<size_t>(bytes), cudaHostAllocPortable | cudaHostAllocMapped);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return CudaStatus(err, absl::StrFormat("cudaHostAlloc of %d pinned bytes for %s", bytes, what));
  }
  b.bytes_ = bytes;
  return b;
}

void PinnedBuffer::Reset() {
  if (ptr_ != nullptr) cudaFreeHost(ptr_);
  ptr_ = nullptr;
  bytes_ = 0;
}

absl::Status GemmF16(cublasHandle_t handle, const uint16_t* w, int64_t rows, int64_t cols, const uint16_t* x,
                     int n_tokens, float* y, int64_t ldy, float beta) {
  if (n_tokens <= 0) return absl::OkStatus();
  const float alpha = 1.0f;
  // Column-major view: y (rows x T, ld ldy) = w^T (rows x cols; w is cols x rows, ld cols) * x (cols x T, ld
  // cols).
  return CublasStatus(
      cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(rows), n_tokens, static_cast<int>(cols),
                   &alpha, w, CUDA_R_16F, static_cast<int>(cols), x, CUDA_R_16F, static_cast<int>(cols),
                   &beta, y, CUDA_R_32F, static_cast<int>(ldy), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
      absl::StrCat("cublasGemmEx ", rows, "x", cols, " x ", n_tokens, " tokens"));
}

}  // namespace kvcache::cuda
