#include "worker/backend/cuda/cuda_tier_storage.h"

#include <xxh_x86dispatch.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "worker/backend/cuda/cuda_check.h"
#include "worker/backend/cuda/device_context.h"
#include "worker/backend/cuda/page_copy.h"

namespace kvcache::cuda {
namespace {

using kv::PageChecksum;
using kv::PageId;

class CudaTierStorageImpl final : public CudaTierStorage {
 public:
  CudaTierStorageImpl(std::shared_ptr<const DeviceContext> ctx, TierMemory memory, int64_t n_pages,
                      int64_t page_bytes, DeviceBuffer device, PinnedBuffer pinned, void* pinned_device,
                      int copy_blocks)
      : ctx_(std::move(ctx)),
        memory_(memory),
        n_pages_(n_pages),
        page_bytes_(page_bytes),
        device_(std::move(device)),
        pinned_(std::move(pinned)),
        pinned_device_(pinned_device),
        copy_blocks_(copy_blocks) {}

  int64_t num_pages() const override { return n_pages_; }
  int64_t page_bytes() const override { return page_bytes_; }
  TierMemory memory() const override { return memory_; }
  void* slab() const override { return memory_ == TierMemory::kDevice ? device_.get() : pinned_.get(); }
  const DeviceContext& context() const override { return *ctx_; }
  void set_copy_path(CopyPath path) override { copy_path_.store(path); }
  void DropRestoreRecords() override {
    absl::MutexLock lock(&mu_);
    restored_from_.clear();
  }

  absl::Status CopyPages(const kv::TierStorage& src, absl::Span<const PageId> src_ids,
                         absl::Span<const PageId> dst_ids) override {
    if (src.page_bytes() != page_bytes_ || src_ids.size() != dst_ids.size()) {
      return absl::InvalidArgumentError("CopyPages: page size or id count mismatch");
    }
    for (size_t i = 0; i < src_ids.size(); ++i) {
      if (!InRange(dst_ids[i]) || src_ids[i] < 0 || src_ids[i] >= src.num_pages()) {
        return absl::InvalidArgumentError(
            absl::StrCat("CopyPages: page id out of range: ", src_ids[i], " -> ", dst_ids[i]));
      }
    }
    if (src_ids.empty()) return absl::OkStatus();
    // Where the source bytes live: our own storage (device or pinned), or any
    // host-addressable storage.
    const auto* cuda_src = dynamic_cast<const CudaTierStorage*>(&src);
    const bool src_device = cuda_src != nullptr && cuda_src->memory() == TierMemory::kDevice;
    if (cuda_src != nullptr && &cuda_src->context() != ctx_.get()) {
      return absl::UnimplementedError("CopyPages between two CUDA devices");
    }
    if (!src_device && src.PageData(src_ids[0]) == nullptr) {
      return absl::UnimplementedError(
          "CopyPages: source tier is neither host-addressable nor on this device");
    }
    const bool dst_device = memory_ == TierMemory::kDevice;
    {
      absl::MutexLock lock(&mu_);
      for (PageId d : dst_ids) restored_from_.erase(d);
    }
    if (!src_device && !dst_device) {  // host -> host
      for (size_t i = 0; i < src_ids.size(); ++i) {
        std::memmove(HostPage(dst_ids[i]), src.PageData(src_ids[i]), static_cast<size_t>(page_bytes_));
      }
      return absl::OkStatus();
    }
    KVCACHE_RETURN_IF_ERROR(ctx_->Activate());
    KVCACHE_RETURN_IF_ERROR(ctx_->CopyAfterCompute());
    absl::MutexLock copy_lock(&copy_mu_);
    const auto* cuda_src_impl = static_cast<const CudaTierStorageImpl*>(cuda_src);
    const CopyPath path = copy_path_.load();
    // The kernel reads and writes both sides through device-visible addresses.
    const bool kernel_ok =
        cuda_src_impl != nullptr && cuda_src_impl->device_visible() != nullptr &&
        device_visible() != nullptr &&
        PageCopyKernelSupports(page_bytes_, cuda_src_impl->device_visible(), device_visible());
    if ((path == CopyPath::kAuto || path == CopyPath::kKernel) && kernel_ok) {
      KVCACHE_RETURN_IF_ERROR(KernelCopy(*cuda_src_impl, src_ids, dst_ids));
    } else {
      // Runs where both sides are consecutive: one copy each.
      const cudaMemcpyKind kind = src_device
                                      ? (dst_device ? cudaMemcpyDeviceToDevice : cudaMemcpyDeviceToHost)
                                      : cudaMemcpyHostToDevice;
      std::vector<const void*> froms;
      std::vector<void*> tos;
      std::vector<size_t> sizes;
      size_t i = 0;
      while (i < src_ids.size()) {
        size_t run = 1;
        while (i + run < src_ids.size() && src_ids[i + run] == src_ids[i] + PageId(run) &&
               dst_ids[i + run] == dst_ids[i] + PageId(run)) {
          ++run;
        }
        froms.push_back(src_device ? static_cast<const uint8_t*>(cuda_src->slab()) + src_ids[i] * page_bytes_
                                   : static_cast<const void*>(src.PageData(src_ids[i])));
        tos.push_back(PagePtr(dst_ids[i]));
        sizes.push_back(run * static_cast<size_t>(page_bytes_));
        i += run;
      }
      if (path == CopyPath::kBatched) {
        cudaMemcpyAttributes attr{};
        attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
        size_t attr_idx = 0;
        KVCACHE_CUDA_RETURN_IF_ERROR(cudaMemcpyBatchAsync(tos.data(), froms.data(), sizes.data(), tos.size(),
                                                          &attr, &attr_idx, 1, ctx_->copy_stream()),
                                     "CopyPages: cudaMemcpyBatchAsync");
      } else {
        for (size_t r = 0; r < tos.size(); ++r) {
          KVCACHE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(tos[r], froms[r], sizes[r], kind, ctx_->copy_stream()),
                                       "CopyPages: cudaMemcpyAsync");
        }
      }
    }
    KVCACHE_RETURN_IF_ERROR(ctx_->SyncCopy("CopyPages: wait for the copy stream"));
    if (dst_device && !src_device) {
      // Remember the host source of each restored page (see the header).
      absl::MutexLock lock(&mu_);
      for (size_t j = 0; j < src_ids.size(); ++j) restored_from_[dst_ids[j]] = src.PageData(src_ids[j]);
    }
    return absl::OkStatus();
  }

  absl::Status ReadPage(PageId id, int64_t offset, absl::Span<uint8_t> dst) const override {
    KVCACHE_RETURN_IF_ERROR(CheckRange(id, offset, dst.size()));
    if (memory_ == TierMemory::kPinnedHost) {
      std::memcpy(dst.data(), HostPage(id) + offset, dst.size());
      return absl::OkStatus();
    }
    KVCACHE_RETURN_IF_ERROR(ctx_->Activate());
    KVCACHE_RETURN_IF_ERROR(ctx_->CopyAfterCompute());
    KVCACHE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst.data(), PagePtr(id) + offset, dst.size(),
                                                 cudaMemcpyDeviceToHost, ctx_->copy_stream()),
                                 "ReadPage: cudaMemcpyAsync");
    return ctx_->SyncCopy("ReadPage: wait for the copy stream");
  }

  absl::Status WritePage(PageId id, int64_t offset, absl::Span<const uint8_t> src) override {
    KVCACHE_RETURN_IF_ERROR(CheckRange(id, offset, src.size()));
    {
      absl::MutexLock lock(&mu_);
      restored_from_.erase(id);
    }
    if (memory_ == TierMemory::kPinnedHost) {
      std::memcpy(HostPage(id) + offset, src.data(), src.size());
      return absl::OkStatus();
    }
    KVCACHE_RETURN_IF_ERROR(ctx_->Activate());
    KVCACHE_RETURN_IF_ERROR(ctx_->CopyAfterCompute());
    KVCACHE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(PagePtr(id) + offset, src.data(), src.size(),
                                                 cudaMemcpyHostToDevice, ctx_->copy_stream()),
                                 "WritePage: cudaMemcpyAsync");
    return ctx_->SyncCopy("WritePage: wait for the copy stream");
  }

  absl::StatusOr<PageChecksum> Checksum(PageId id) const override {
    if (!InRange(id)) return absl::InvalidArgumentError(absl::StrCat("bad page id ", id));
    if (memory_ == TierMemory::kPinnedHost) {
      return XXH3_64bits_dispatch(HostPage(id), static_cast<size_t>(page_bytes_));
    }
    absl::MutexLock lock(&mu_);
    if (auto it = restored_from_.find(id); it != restored_from_.end()) {
      const PageChecksum sum = XXH3_64bits_dispatch(it->second, static_cast<size_t>(page_bytes_));
      restored_from_.erase(it);
      return sum;
    }
    if (staging_.get() == nullptr) {
      KVCACHE_ASSIGN_OR_RETURN(staging_, PinnedBuffer::Allocate(page_bytes_, "checksum staging page"));
    }
    KVCACHE_RETURN_IF_ERROR(ctx_->Activate());
    KVCACHE_RETURN_IF_ERROR(ctx_->CopyAfterCompute());
    KVCACHE_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(staging_.get(), PagePtr(id), static_cast<size_t>(page_bytes_), cudaMemcpyDeviceToHost,
                        ctx_->copy_stream()),
        "Checksum: cudaMemcpyAsync");
    KVCACHE_RETURN_IF_ERROR(ctx_->SyncCopy("Checksum: wait for the copy stream"));
    return XXH3_64bits_dispatch(staging_.get(), static_cast<size_t>(page_bytes_));
  }

  uint8_t* PageData(PageId id) override {
    return memory_ == TierMemory::kPinnedHost && InRange(id) ? HostPage(id) : nullptr;
  }
  const uint8_t* PageData(PageId id) const override {
    return memory_ == TierMemory::kPinnedHost && InRange(id) ? HostPage(id) : nullptr;
  }

 private:
  bool InRange(PageId id) const { return id >= 0 && id < n_pages_; }
  absl::Status CheckRange(PageId id, int64_t offset, size_t len) const {
    if (!InRange(id) || offset < 0 || offset + static_cast<int64_t>(len) > page_bytes_) {
      return absl::InvalidArgumentError(
          absl::StrCat("page access out of range: page ", id, " [", offset, ", +", len, ")"));
    }
    return absl::OkStatus();
  }
  uint8_t* HostPage(PageId id) const { return pinned_.as<uint8_t>() + int64_t{id} * page_bytes_; }
  // Base of the slab as kernels address it (the pinned slab's device mapping),
  // or null when the pinned slab has none.
  uint8_t* device_visible() const {
    return static_cast<uint8_t*>(memory_ == TierMemory::kDevice ? device_.get() : pinned_device_);
  }

  // One CopyPagesKernel launch over the batch; the page list travels in a mapped
  // pinned buffer (read by the kernel in place, reused once the copy completed).
  absl::Status KernelCopy(const CudaTierStorageImpl& src, absl::Span<const PageId> src_ids,
                          absl::Span<const PageId> dst_ids) ABSL_EXCLUSIVE_LOCKS_REQUIRED(copy_mu_) {
    const int64_t need = static_cast<int64_t>(src_ids.size() * sizeof(PageCopyOp));
    if (ops_.bytes() < need) {
      ops_.Reset();
      KVCACHE_ASSIGN_OR_RETURN(ops_, PinnedBuffer::Allocate(std::max<int64_t>(need, 4096), "page copy list"));
      void* dev = nullptr;
      KVCACHE_CUDA_RETURN_IF_ERROR(cudaHostGetDevicePointer(&dev, ops_.get(), 0), "page copy list mapping");
      ops_device_ = static_cast<PageCopyOp*>(dev);
    }
    PageCopyOp* ops = ops_.as<PageCopyOp>();
    const uint8_t* from = src.device_visible();
    uint8_t* to = device_visible();
    for (size_t i = 0; i < src_ids.size(); ++i) {
      ops[i].src = from + src_ids[i] * page_bytes_;
      ops[i].dst = to + dst_ids[i] * page_bytes_;
    }
    return CopyPagesKernel(ops_device_, static_cast<int>(src_ids.size()), page_bytes_, copy_blocks_,
                           ctx_->copy_stream());
  }
  uint8_t* PagePtr(PageId id) const { return static_cast<uint8_t*>(slab()) + int64_t{id} * page_bytes_; }

  const std::shared_ptr<const DeviceContext> ctx_;
  const TierMemory memory_;
  const int64_t n_pages_;
  const int64_t page_bytes_;
  DeviceBuffer device_;
  PinnedBuffer pinned_;
  void* const pinned_device_;  // pinned_ as the device addresses it, or null
  const int copy_blocks_;      // CopyPagesKernel grid bound
  std::atomic<CopyPath> copy_path_{CopyPath::kAuto};
  absl::Mutex copy_mu_;  // one CopyPages into this storage at a time uses ops_
  PinnedBuffer ops_ ABSL_GUARDED_BY(copy_mu_);
  PageCopyOp* ops_device_ ABSL_GUARDED_BY(copy_mu_) = nullptr;
  mutable absl::Mutex mu_;
  mutable PinnedBuffer staging_ ABSL_GUARDED_BY(mu_);
  // Device pages restored from host memory -> that memory (see the header).
  mutable absl::flat_hash_map<PageId, const uint8_t*> restored_from_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

absl::StatusOr<std::unique_ptr<CudaTierStorage>> CudaTierStorage::Create(
    std::shared_ptr<const DeviceContext> ctx, TierMemory memory, int64_t n_pages, int64_t page_bytes,
    absl::string_view budget_flag) {
  if (ctx == nullptr || n_pages < 0 || page_bytes <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("CudaTierStorage: bad size ", n_pages, " x ", page_bytes));
  }
  KVCACHE_RETURN_IF_ERROR(ctx->Activate());
  const int64_t bytes = n_pages * page_bytes;
  DeviceBuffer device;
  PinnedBuffer pinned;
  const std::string what =
      absl::StrFormat("%s tier (%d pages of %d bytes)",
                      memory == TierMemory::kDevice ? "device" : "pinned host", n_pages, page_bytes);
  absl::Status alloc;
  if (memory == TierMemory::kDevice) {
    absl::StatusOr<DeviceBuffer> b = DeviceBuffer::Allocate(bytes, what);
    if (b.ok()) {
      device = std::move(*b);
      if (bytes > 0) alloc = CudaStatus(cudaMemset(device.get(), 0, static_cast<size_t>(bytes)), "zero tier");
    } else {
      alloc = b.status();
    }
  } else {
    absl::StatusOr<PinnedBuffer> b = PinnedBuffer::Allocate(bytes, what);
    if (b.ok()) {
      pinned = std::move(*b);
      if (bytes > 0) std::memset(pinned.get(), 0, static_cast<size_t>(bytes));
    } else {
      alloc = b.status();
    }
  }
  if (absl::IsResourceExhausted(alloc)) {
    return absl::ResourceExhaustedError(
        absl::StrCat("out of ", memory == TierMemory::kDevice ? "device" : "pinned host", " memory on ",
                     ctx->Describe(), ": ", alloc.message(), "; lower ", budget_flag));
  }
  if (!alloc.ok()) return alloc;
  // The pinned slab's device mapping (UVA: the same address), for the copy kernel.
  void* pinned_device = nullptr;
  if (pinned.get() != nullptr && cudaHostGetDevicePointer(&pinned_device, pinned.get(), 0) != cudaSuccess) {
    cudaGetLastError();
    pinned_device = nullptr;  // CopyPages uses cudaMemcpyAsync instead
  }
  int sms = 0;
  KVCACHE_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, ctx->device()),
                               "multiprocessor count");
  return std::unique_ptr<CudaTierStorage>(new CudaTierStorageImpl(std::move(ctx), memory, n_pages, page_bytes,
                                                                  std::move(device), std::move(pinned),
                                                                  pinned_device, 2 * std::max(sms, 1)));
}

}  // namespace kvcache::cuda
