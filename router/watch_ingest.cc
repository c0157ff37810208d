#include "router/watch_ingest.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace kvcache::router {

WatchIngest::WatchIngest(Directory* directory, WorkerId worker)
    : directory_(directory), worker_(std::move(worker)) {}

void WatchIngest::Reset() {
  expected_ = 1;
  broken_ = false;
  gathering_ = false;
  parts_.Clear();
}

absl::StatusOr<WatchIngest::Applied> WatchIngest::Ingest(v1::WatchEvent* ev) {
  if (broken_) return absl::DataLossError("watch stream broken by a gap; resync");
  if (ev->sequence() != expected_) {
    broken_ = true;
    ++gaps_;
    return absl::DataLossError(
        absl::StrCat("watch sequence ", ev->sequence(), " after ", expected_ - 1, "; resync"));
  }
  ++expected_;
  if (ev->has_snapshot()) {
    if (!gathering_) {
      parts_ = std::move(*ev->mutable_snapshot());
      gathering_ = true;
    } else {
      v1::WorkerSnapshot& part = *ev->mutable_snapshot();
      for (auto& s : *part.mutable_sessions()) *parts_.add_sessions() = std::move(s);
      for (auto& h : *part.mutable_device_block_hashes()) parts_.add_device_block_hashes(std::move(h));
      for (auto& h : *part.mutable_host_block_hashes()) parts_.add_host_block_hashes(std::move(h));
      parts_.set_more(part.more());
    }
    if (parts_.more()) return Applied::kSnapshotPart;  // applied whole, once the last part is in
    gathering_ = false;
    *ev->mutable_snapshot() = std::move(parts_);
    parts_.Clear();
    directory_->ApplySnapshot(worker_, ev->snapshot());
    return Applied::kSnapshot;
  }
  if (gathering_) {
    broken_ = true;
    ++gaps_;
    return absl::DataLossError("watch message inside a snapshot; resync");
  }
  if (ev->has_event()) {
    directory_->ApplyEvent(worker_, ev->event());
    return Applied::kEvent;
  }
  if (ev->has_load()) {
    directory_->ApplyLoad(worker_, ev->load());
    return Applied::kLoad;
  }
  return Applied::kNone;
}

}  // namespace kvcache::router
