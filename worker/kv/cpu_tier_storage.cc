// Host-memory TierStorage: one aligned slab, memcpy for copies.
//
// Checksums use libxxhash's run-time dispatched XXH3 (SSE2/AVX2/AVX-512 picked on the
// running CPU), so a baseline x86-64 build still hashes at full vector width.
#include <sys/mman.h>
#include <xxh_x86dispatch.h>
#include <xxhash.h>

#include <cstdlib>
#include <cstring>
#include <new>

#include "absl/strings/str_cat.h"
#include "worker/kv/tier_storage.h"

namespace kvcache::kv {
namespace {

class CpuTierStorage final : public TierStorage {
 public:
  CpuTierStorage(uint8_t* slab, int64_t n_pages, int64_t page_bytes, int64_t mapped_bytes)
      : slab_(slab), n_pages_(n_pages), page_bytes_(page_bytes), mapped_bytes_(mapped_bytes) {}
  ~CpuTierStorage() override {
    if (slab_ != nullptr) munmap(slab_, static_cast<size_t>(mapped_bytes_));
  }
  CpuTierStorage(const CpuTierStorage&) = delete;
  CpuTierStorage& operator=(const CpuTierStorage&) = delete;

  int64_t num_pages() const override { return n_pages_; }
  int64_t page_bytes() const override { return page_bytes_; }

  absl::Status CopyPages(const TierStorage& src, absl::Span<const PageId> src_ids,
                         absl::Span<const PageId> dst_ids) override {
    if (src.page_bytes() != page_bytes_ || src_ids.size() != dst_ids.size()) {
      return absl::InvalidArgumentError("CopyPages: page size or id count mismatch");
    }
    size_t i = 0;
    while (i < src_ids.size()) {
      if (!InRange(dst_ids[i]) || src_ids[i] < 0 || src_ids[i] >= src.num_pages()) {
        return absl::InvalidArgumentError(
            absl::StrCat("CopyPages: page id out of range: ", src_ids[i], " -> ", dst_ids[i]));
      }
      // Coalesce a run where both sides are consecutive: one memcpy per run.
      size_t run = 1;
      while (i + run < src_ids.size() && src_ids[i + run] == src_ids[i] + PageId(run) &&
             dst_ids[i + run] == dst_ids[i] + PageId(run) && InRange(dst_ids[i + run]) &&
             src_ids[i + run] < src.num_pages()) {
        ++run;
      }
      const uint8_t* from = src.PageData(src_ids[i]);
      if (from == nullptr) {
        return absl::UnimplementedError("CopyPages: source tier is not host-addressable");
      }
      uint8_t* to = PageData(dst_ids[i]);
      if (from != to) std::memmove(to, from, run * page_bytes_);
      i += run;
    }
    return absl::OkStatus();
  }

  absl::Status ReadPage(PageId id, int64_t offset, absl::Span<uint8_t> dst) const override {
    if (absl::Status s = CheckRange(id, offset, dst.size()); !s.ok()) return s;
    std::memcpy(dst.data(), PageData(id) + offset, dst.size());
    return absl::OkStatus();
  }

  absl::Status WritePage(PageId id, int64_t offset, absl::Span<const uint8_t> src) override {
    if (absl::Status s = CheckRange(id, offset, src.size()); !s.ok()) return s;
    std::memcpy(PageData(id) + offset, src.data(), src.size());
    return absl::OkStatus();
  }

  absl::StatusOr<PageChecksum> Checksum(PageId id) const override {
    if (!InRange(id)) return absl::InvalidArgumentError(absl::StrCat("bad page id ", id));
    return XXH3_64bits_dispatch(PageData(id), static_cast<size_t>(page_bytes_));
  }

  uint8_t* PageData(PageId id) override { return InRange(id) ? slab_ + int64_t{id} * page_bytes_ : nullptr; }
  const uint8_t* PageData(PageId id) const override {
    return InRange(id) ? slab_ + int64_t{id} * page_bytes_ : nullptr;
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

  uint8_t* const slab_;
  const int64_t n_pages_;
  const int64_t page_bytes_;
  const int64_t mapped_bytes_;
};

}  // namespace

absl::StatusOr<TierStoragePtr> CreateCpuTierStorage(int64_t n_pages, int64_t page_bytes) {
  if (n_pages < 0 || page_bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("CreateCpuTierStorage: bad size ", n_pages, " x ", page_bytes));
  }
  // An anonymous mapping: page-aligned, zero-filled, and committed lazily, so a
  // large budget costs memory only as pages are first written (no memset of
  // the whole slab at start-up).
  const int64_t bytes = n_pages * page_bytes;
  uint8_t* slab = nullptr;
  if (bytes > 0) {
    void* p =
        mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", bytes, " bytes"));
    }
    // Transparent huge pages where the kernel allows them: attention reads a
    // session's pages scattered over the slab, and with 4 KiB pages nearly every
    // 12 KiB run of a layer's K/V misses the TLB. Advice only: ignore failure.
    (void)madvise(p, static_cast<size_t>(bytes), MADV_HUGEPAGE);
    slab = static_cast<uint8_t*>(p);
  }
  return TierStoragePtr(new CpuTierStorage(slab, n_pages, page_bytes, bytes));
}

}  // namespace kvcache::kv
