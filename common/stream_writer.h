// A server-streaming reactor that queues messages pushed from any thread and
// writes them one at a time, as gRPC requires; Close() finishes the stream
// after everything queued has been written.
//
// Subclasses override OnClientGone() (client cancelled or a write failed) and
// OnFinished() (on gRPC's OnDone).
//
// Lifetime: the object deletes itself once gRPC has called OnDone and every
// holder has let go. It starts with one reference, gRPC's, dropped in OnDone. A
// producer that calls in from its own thread (the engine, a proxy) takes a
// reference with Ref() before it can reach the object and drops it with Unref()
// after its last call, so a stream that gRPC finishes early (client gone, write
// failed) never leaves the producer holding a dangling pointer.
//
// Thread-safety: Push, Close, Ref and Unref may be called from any thread.
#ifndef KVCACHE_COMMON_STREAM_WRITER_H_
#define KVCACHE_COMMON_STREAM_WRITER_H_

#include <atomic>
#include <cassert>
#include <deque>

#include "absl/synchronization/mutex.h"
#include "grpcpp/grpcpp.h"

namespace kvcache {

template <typename Msg>
class StreamWriter : public grpc::ServerWriteReactor<Msg> {
 public:
  // `max_queued`: a client that lets more messages pile up is cut off with
  // UNAVAILABLE (0 = unbounded).
  explicit StreamWriter(size_t max_queued = 0) : max_queued_(max_queued) {}

  // Queues a message; false once the stream is closed.
  bool Push(Msg msg) {
    grpc::Status finish;
    {
      absl::MutexLock lock(&mu_);
      if (closed_) return false;
      if (max_queued_ == 0 || queue_.size() < max_queued_) {
        queue_.push_back(std::move(msg));
        if (!writing_) {
          writing_ = true;
          this->StartWrite(&queue_.front());
        }
        return true;
      }
      if (!CloseLocked(grpc::Status(grpc::StatusCode::UNAVAILABLE, "reader fell behind; reconnect"),
                       /*drop_queued=*/true, &finish)) {
        return false;
      }
    }
    this->Finish(finish);  // outside the lock: may delete this
    return false;
  }

  // Finishes with `status` once the queue is written (at once when a write
  // failed), an error status too: the client reads every message pushed before
  // it (a Generate stream cut by a drain delivers every token its session
  // kept). Later calls are ignored.
  void Close(const grpc::Status& status) {
    grpc::Status finish;
    {
      absl::MutexLock lock(&mu_);
      if (!CloseLocked(status, /*drop_queued=*/false, &finish)) return;
    }
    // Outside the lock: gRPC may call OnDone (which deletes this) on another
    // thread as soon as Finish is called.
    this->Finish(finish);
  }

  // Close, with `before_finish` run first if the call is still open: it may add
  // trailing metadata to the call's context, which gRPC frees once the call
  // has finished (a client gone or a failed write finishes it early, and then
  // `before_finish` is not run).
  template <typename F>
  void Close(const grpc::Status& status, F before_finish) {
    grpc::Status finish;
    {
      absl::MutexLock lock(&mu_);
      if (!finish_sent_) before_finish();
      if (!CloseLocked(status, /*drop_queued=*/false, &finish)) return;
    }
    this->Finish(finish);  // outside the lock, as in Close
  }

  void OnWriteDone(bool ok) override {
    bool gone = false;
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      if (!queue_.empty()) queue_.pop_front();
      if (!ok) {
        queue_.clear();
        gone = true;
        if (!closed_) closed_ = true;
        if (!finish_sent_) {
          finish_sent_ = true;
          this->Finish(grpc::Status(grpc::StatusCode::CANCELLED, "client went away"));
        }
      } else if (!queue_.empty()) {
        writing_ = true;
        this->StartWrite(&queue_.front());
      } else if (closed_ && !finish_sent_) {
        finish_sent_ = true;
        this->Finish(status_);
      }
    }
    if (gone) OnClientGone();
  }

  void OnCancel() override { OnClientGone(); }

  void OnDone() override {
    OnFinished();
    Unref();
  }

  // REQUIRES: the caller holds a reference already (or is gRPC's handler that
  // created the object), so the count cannot be 0.
  void Ref() {
    const int before = refs_.fetch_add(1, std::memory_order_relaxed);
    assert(before > 0);
    (void)before;
  }
  // Drops a reference; the last one deletes the object.
  void Unref() {
    if (refs_.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
  }

 protected:
  virtual void OnClientGone() {}
  virtual void OnFinished() {}

 private:
  // True when the caller must call Finish(*finish) once it released mu_.
  // `drop_queued`: messages not yet being written are dropped.
  bool CloseLocked(const grpc::Status& status, bool drop_queued, grpc::Status* finish)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (closed_) return false;
    closed_ = true;
    status_ = status;
    if (drop_queued) queue_.erase(queue_.begin() + (writing_ ? 1 : 0), queue_.end());
    if (!writing_ && !finish_sent_) {
      finish_sent_ = true;
      *finish = status_;
      return true;
    }
    return false;
  }

  const size_t max_queued_;
  std::atomic<int> refs_{1};  // gRPC's, until OnDone
  absl::Mutex mu_;
  std::deque<Msg> queue_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  bool finish_sent_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status status_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvcache

#endif  // KVCACHE_COMMON_STREAM_WRITER_H_
