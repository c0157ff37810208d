#include "router/router_service.h"

#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <type_traits>

#include "absl/algorithm/container.h"
#include "absl/random/random.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/block_hash.h"
#include "common/input_tokens.h"
#include "common/logging.h"
#include "common/session_id.h"
#include "common/status.h"
#include "common/stream_writer.h"
#include "kvcache/v1/worker.grpc.pb.h"

namespace kvcache::router {
namespace {

// Workers a move to a worker the router picks tries before it gives up (each
// refusal leaves the session where it was).
constexpr int kMaxMoveTargets = 3;

std::string CodeName(const grpc::Status& st) {
  return absl::StatusCodeToString(static_cast<absl::StatusCode>(st.error_code()));
}

// Deadline for a call to a worker on behalf of `context` (the client's deadline,
// or `fallback` when it has none).
std::chrono::system_clock::time_point DeadlineFor(const grpc::CallbackServerContext* context,
                                                  absl::Duration fallback) {
  auto d = context->deadline();
  auto limit = std::chrono::system_clock::now() + absl::ToChronoSeconds(fallback);
  return d < limit ? d : limit;
}

bool Retryable(grpc::StatusCode code) {
  // OUT_OF_RANGE: a context over that worker's limits (another may hold more).
  return code == grpc::RESOURCE_EXHAUSTED || code == grpc::UNAVAILABLE || code == grpc::OUT_OF_RANGE;
}

// Codes a worker answers with itself, never a transport's: a call that ended
// with one reached a live worker.
bool WorkerAnswered(grpc::StatusCode code) {
  return code == grpc::RESOURCE_EXHAUSTED || code == grpc::OUT_OF_RANGE || code == grpc::INVALID_ARGUMENT ||
         code == grpc::FAILED_PRECONDITION || code == grpc::DATA_LOSS;
}

// ABORTED's message for a request on a session that a request holds on a
// draining worker (which moves the session once that request ends).
std::string BusyOnDrainingWorker(const std::string& session_id, const WorkerId& worker) {
  return absl::StrCat("session '", session_id, "' is busy on worker ", worker,
                      ", which is draining: it moves when its request there ends");
}

}  // namespace

absl::StatusOr<PlacementMode> ParsePlacementMode(const std::string& s) {
  if (s == "affinity") return PlacementMode::kAffinity;
  if (s == "round_robin") return PlacementMode::kRoundRobin;
  if (s == "random") return PlacementMode::kRandom;
  return absl::InvalidArgumentError(
      absl::StrCat("--placement='", s, "': want affinity, round_robin or random"));
}

// One client Generate: places it, proxies the worker's stream through a
// callback call (WorkerCall), and retries or continues elsewhere as the header
// comment says. No thread is its own: each step runs on the gRPC thread that
// delivered the event before it, or on the executor for an APPEND's wait.
//
// Steps never overlap: Start, then per attempt a placement, the worker call's
// reads and its OnDone, which starts the next attempt or finishes; each step's
// last action hands over to the next. So the proxy's own state needs no lock
// (gRPC orders one callback after the next). Only OnClientGone, which gRPC may
// call at any time, meets them, through mu_.
//
// References (StreamWriter's rule): the proxy holds one from Generate until its
// last call, in Finish; every WorkerCall runs inside that span.
class RouterService::ProxyReactor : public StreamWriter<v1::GenerateResponse> {
 public:
  ProxyReactor(RouterService* router, v1::GenerateRequest request,
               std::chrono::system_clock::time_point deadline)
      : router_(router), request_(std::move(request)), deadline_(deadline), start_(absl::Now()) {}

  // REQUIRES: the caller took the proxy's reference (Ref()) and counted the
  // call (BeginCall()); Finish releases both. `context` is only read here.
  void Start(const grpc::CallbackServerContext& context) {
    auto principal = router_->auth_->Authenticate(context, /*need_admin=*/false);
    if (!principal.ok()) return Finish(ToGrpcStatus(principal.status()));
    request_.set_tenant(principal->tenant);
    request_.set_continued_tokens(0);  // the router's to set (Attempt)
    // One id for every attempt: a reply cut on one worker goes on only where
    // the session's last request is still this one.
    thread_local absl::BitGen bits;
    request_.set_request_id(
        absl::StrFormat("%016x%016x", absl::Uniform<uint64_t>(bits), absl::Uniform<uint64_t>(bits)));
    append_ = request_.mode() == v1::APPEND;
    if (append_ && request_.session_id().empty()) {
      return Finish(grpc::Status(grpc::INVALID_ARGUMENT, "APPEND mode needs a session_id"));
    }
    // The router's own tokenisation: for prefix hashes, and to continue a lost
    // stream elsewhere from exactly what the client has.
    auto tokens = TokenizeInput(request_.input(), append_, *router_->tokenizer_, router_->chat_template_);
    if (!tokens.ok()) return Finish(ToGrpcStatus(tokens.status()));
    tokens_ = std::move(*tokens);
    NextAttempt();
  }

 private:
  // One attempt: the worker's Generate stream, read through gRPC's callback API
  // (a read is always pending until the stream ends, so no thread waits on it).
  // It deletes itself once gRPC has called OnDone and no one else holds it
  // (OnClientGone holds it while it cancels).
  class WorkerCall final : public grpc::ClientReadReactor<v1::GenerateResponse> {
   public:
    WorkerCall(ProxyReactor* proxy, std::shared_ptr<grpc::Channel> channel, v1::GenerateRequest request,
               std::chrono::system_clock::time_point deadline)
        : proxy_(proxy), stub_(v1::Worker::NewStub(channel)), request_(std::move(request)) {
      ctx_.set_deadline(deadline);
    }

    void Start() {
      stub_->async()->Generate(&ctx_, &request_, this);
      StartRead(&msg_);
      StartCall();
    }

    void Cancel() { ctx_.TryCancel(); }

    void Ref() { refs_.fetch_add(1, std::memory_order_relaxed); }
    void Unref() {
      if (refs_.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
    }

    void OnReadDone(bool ok) override {
      if (!ok) return;  // the stream ended: OnDone follows
      proxy_->OnWorkerMessage(&msg_);
      StartRead(&msg_);
    }

    void OnDone(const grpc::Status& status) override {
      std::optional<v1::Usage> usage;  // of a stream the worker cut after tokens
      const auto& trailer = ctx_.GetServerTrailingMetadata();
      if (auto it = trailer.find(kUsageTrailer); it != trailer.end()) {
        usage.emplace();
        if (!usage->ParseFromArray(it->second.data(), static_cast<int>(it->second.size()))) usage.reset();
      }
      proxy_->OnAttemptDone(this, status, usage);  // may start the next attempt or finish the proxy
      Unref();
    }

   private:
    ProxyReactor* const proxy_;
    std::unique_ptr<v1::Worker::Stub> stub_;
    grpc::ClientContext ctx_;
    v1::GenerateRequest request_;
    v1::GenerateResponse msg_;
    // The creator's until Start, then gRPC's until OnDone; OnClientGone adds one
    // while it cancels.
    std::atomic<int> refs_{1};
  };

  // Places the next attempt and starts it, or finishes when none is left.
  void NextAttempt() {
    if (attempts_ >= router_->options_.max_attempts) return Finish(Refused());
    if (client_gone_.load()) return Finish(grpc::Status(grpc::CANCELLED, "client cancelled"));
    // A FULL_CONTEXT turn on a session that a request holds on a draining
    // worker is ABORTED, as on a busy session anywhere (that worker refuses it
    // as draining first, so the router says it). Before, it ran on another
    // worker, made a second copy there and cut the running stream short
    // (qa35). Also on a retry: a worker that began draining a moment ago
    // refuses the first attempt. Asking the worker blocks: on the executor.
    if (!append_ && emitted_.empty() && !request_.session_id().empty()) {
      const SessionKey key{request_.tenant(), request_.session_id()};
      if (std::optional<SessionLocation> home = router_->DrainingHome(key)) {
        if (!router_->executor_.Schedule([this, key, home = *home] {
              if (router_->SessionBusyOn(key, home, /*moving_counts=*/false)) {
                return Finish(grpc::Status(grpc::ABORTED, BusyOnDrainingWorker(key.session_id, home.worker)));
              }
              Attempt(absl::ZeroDuration());
            })) {
          Finish(grpc::Status(grpc::RESOURCE_EXHAUSTED, "the router is overloaded; retry later"));
        }
        return;
      }
    }
    // An APPEND whose session the directory has not heard of yet waits a moment
    // for the worker's placement event (it may trail the reply that created the
    // session). That wait blocks, so it runs on the executor.
    if (append_ && router_->MustWaitForSession({request_.tenant(), request_.session_id()})) {
      if (!router_->executor_.Schedule([this] { Attempt(router_->options_.session_lookup_wait); })) {
        Finish(grpc::Status(grpc::RESOURCE_EXHAUSTED, "the router is overloaded; retry later"));
      }
      return;
    }
    Attempt(absl::ZeroDuration());
  }

  void Attempt(absl::Duration session_wait) {
    // A placement reads the ledger and records its choice there under one
    // lock, so that each placement of a burst sees every one before it. An
    // APPEND follows its session (and may wait for it), so it takes no part.
    std::optional<absl::MutexLock> serial;
    if (!append_) serial.emplace(&router_->placement_mu_);
    auto placement = router_->Place(request_.session_id(), request_.tenant(), append_, tokens_,
                                    request_.sampling().max_tokens(), tried_, session_wait, &chain_);
    if (!placement.ok()) {
      serial.reset();
      return Finish(tried_.empty() ? ToGrpcStatus(placement.status()) : Refused());
    }
    if (attempts_ > 0) {
      placement->reason = PlacementReason::kRetry;
      router_->metrics_->OnRetry();
    }
    router_->metrics_->OnDecision(
        router_->options_.mode == PlacementMode::kAffinity
            ? PlacementReasonName(placement->reason)
            : (router_->options_.mode == PlacementMode::kRoundRobin ? "round_robin" : "random"));
    tried_.push_back(placement->worker);
    ++attempts_;
    placement_ = *placement;

    v1::GenerateRequest req = request_;
    if (!emitted_.empty() && append_) {
      // Go on the session's cut reply, from what the client already received:
      // the session holds the turn's input and those tokens (the worker counts
      // them against max_tokens, samples past them and matches stop strings
      // across them).
      req.clear_input();
      req.clear_tokens_read();
      req.set_continued_tokens(static_cast<int32_t>(emitted_.size()));
    } else if (!emitted_.empty()) {
      // Continue from what the client already received.
      std::vector<int32_t> input = tokens_;
      input.insert(input.end(), emitted_.begin(), emitted_.end());
      req.mutable_input()->mutable_tokens()->mutable_ids()->Assign(input.begin(), input.end());
      req.set_mode(v1::FULL_CONTEXT);
      // The worker counts them against max_tokens, samples past them (a seed
      // gives the uninterrupted stream's tokens) and matches stop strings
      // across them.
      req.set_continued_tokens(static_cast<int32_t>(emitted_.size()));
    }
    continued_from_ = emitted_.size();

    auto channel = router_->pool_->Channel(placement_.worker);
    if (channel == nullptr) {
      serial.reset();  // before the retry, which places again
      return OnAttemptDone(nullptr, grpc::Status(grpc::UNAVAILABLE, "worker left the pool"));
    }
    auto* call = new WorkerCall(this, std::move(channel), std::move(req), deadline_);
    bool gone;
    {
      absl::MutexLock lock(&mu_);
      gone = client_gone_.load();
      if (!gone) call_ = call;
    }
    if (gone) {
      serial.reset();
      call->Unref();  // never started
      return Finish(grpc::Status(grpc::CANCELLED, "client cancelled"));
    }
    // Counted against the worker until the attempt ends (its prompt until the
    // first token), so the next placement sees it at once.
    const int64_t context = static_cast<int64_t>(tokens_.size() + emitted_.size());
    dispatched_prefill_ =
        append_ ? context : std::max<int64_t>(1, context - placement_.predicted_cached_tokens);
    router_->ledger_.Dispatch(placement_.worker, chain_, dispatched_prefill_);
    if (!request_.session_id().empty()) {
      const SessionKey key{request_.tenant(), request_.session_id()};
      // A FULL_CONTEXT turn that another worker serves moves the session
      // there; the copy it leaves behind is closed once the turn has created
      // the session on its new worker.
      stale_copies_.clear();
      creates_session_ = false;
      if (!append_) {
        std::vector<WorkerId> homes = router_->SessionHomes(key);
        // The freshest knowledge of where it lives comes first.
        creates_session_ = homes.empty() || homes.front() != placement_.worker;
        for (WorkerId& home : homes) {
          if (home != placement_.worker) stale_copies_.push_back(std::move(home));
        }
      }
      router_->ledger_.SessionDispatched(key, placement_.worker, creates_session_);
      // This turn defines the session on its worker: a copy held back there
      // is current again (it may be reused without a placement event).
      if (!append_) router_->directory_->ClearStale(key, placement_.worker);
    }
    serial.reset();
    call->Start();  // last: its callbacks may run at once, on other threads
  }

  // A message of the current attempt's stream (gRPC thread, one at a time).
  void OnWorkerMessage(v1::GenerateResponse* msg) {
    if (msg->has_token()) {
      if (emitted_.empty()) router_->metrics_->OnFirstToken(absl::ToDoubleSeconds(absl::Now() - start_));
      if (dispatched_prefill_ > 0) {  // the attempt's prompt is in the worker's cache now
        router_->ledger_.PrefillDone(placement_.worker, dispatched_prefill_);
        dispatched_prefill_ = 0;
      }
      emitted_.push_back(msg->token().id());
      // The turn holds the session on its new worker now, and no migration can
      // take it back to a previous one until the stream ends: the copies left
      // there are closed at once, not when the stream ends (by then a drain may
      // have moved the session to one of those workers).
      CloseStaleCopies();
      Push(std::move(*msg));
    } else if (msg->has_final()) {
      auto* f = msg->mutable_final();
      f->set_predicted_cached_tokens(placement_.predicted_cached_tokens);
      router_->metrics_->OnCachedTokens(placement_.predicted_cached_tokens, f->usage().cached_tokens());
      // Report the client's view: after a continuation elsewhere, the worker's
      // prompt included the tokens the client had already received, and its
      // cache may have held some of them too; of the client's prompt, at most
      // all of it was cached (restored_tokens <= cached_tokens <= prompt_tokens).
      v1::Usage* usage = f->mutable_usage();
      usage->set_prompt_tokens(usage->prompt_tokens() - static_cast<int32_t>(continued_from_));
      usage->set_cached_tokens(std::min(usage->cached_tokens(), usage->prompt_tokens()));
      usage->set_restored_tokens(std::min(usage->restored_tokens(), usage->cached_tokens()));
      if (opening_usage_.has_value()) {
        // The client's prompt was served by the attempt that was cut: its
        // figures, not the continuation's (which found the prompt, and the
        // tokens it went on from, all cached). Before, a continued turn
        // reported every prompt token cached (qa34).
        usage->set_cached_tokens(std::min(opening_usage_->cached_tokens(), usage->prompt_tokens()));
        usage->set_restored_tokens(std::min(opening_usage_->restored_tokens(), usage->cached_tokens()));
        usage->set_time_to_first_token_us(opening_usage_->time_to_first_token_us());
        usage->set_queue_time_us(opening_usage_->queue_time_us());
        usage->set_recomputed_tokens(usage->recomputed_tokens() + opening_usage_->recomputed_tokens());
      }
      f->mutable_usage()->set_generated_tokens(static_cast<int32_t>(emitted_.size()));
      if (!f->session_id().empty()) {
        router_->directory_->NoteSessionTokens({request_.tenant(), f->session_id()}, placement_.worker,
                                               f->usage().prompt_tokens() + f->usage().generated_tokens());
      }
      f->mutable_usage()->set_total_time_us(absl::ToInt64Microseconds(absl::Now() - start_));
      Push(std::move(*msg));
    }
  }

  // The answer once every worker tried has refused: the last refusal, but a
  // worker's RESOURCE_EXHAUSTED (no room now: worth retrying later) over any
  // other's, such as OUT_OF_RANGE (a context that worker can never hold) or a
  // lost worker's UNAVAILABLE (the one with no room is still there).
  grpc::Status Refused() const { return !no_room_now_.ok() ? no_room_now_ : last_; }

  // Closes the session's copies that the current attempt left behind on other
  // workers (see stale_copies_), once.
  void CloseStaleCopies() {
    if (stale_copies_.empty()) return;
    const SessionKey key{request_.tenant(), request_.session_id()};
    for (const WorkerId& w : stale_copies_) router_->CloseStaleCopy(key, w);
    stale_copies_.clear();
  }

  // The current attempt ended with `st` (`call` is null when it never started);
  // `usage`: its worker's account of it, when it cut the stream after tokens.
  void OnAttemptDone(WorkerCall* call, const grpc::Status& st, const std::optional<v1::Usage>& usage = {}) {
    if (usage.has_value() && continued_from_ == 0 && !emitted_.empty()) opening_usage_ = usage;
    if (call != nullptr) {
      {
        absl::MutexLock lock(&mu_);
        if (call_ == call) call_ = nullptr;
      }
      router_->ledger_.Finish(placement_.worker, chain_, dispatched_prefill_, /*computed=*/st.ok());
      dispatched_prefill_ = 0;
      if (!request_.session_id().empty()) {
        const SessionKey key{request_.tenant(), request_.session_id()};
        // Its worker holds the session once a token came (or it ended OK).
        const bool held = st.ok() || emitted_.size() > continued_from_;
        router_->ledger_.SessionFinished(key, placement_.worker, creates_session_, held);
        if (held) CloseStaleCopies();  // a turn that ended OK without a token
        stale_copies_.clear();
      }
    }
    last_ = st;
    if (st.error_code() == grpc::RESOURCE_EXHAUSTED) no_room_now_ = st;
    if (st.ok()) return Finish(st);
    if (client_gone_.load()) return Finish(grpc::Status(grpc::CANCELLED, "client cancelled"));
    // Past the client's deadline the client has its DEADLINE_EXCEEDED, whatever
    // ended the worker call (it carries the same deadline, and its timer, or the
    // worker's, can end it before the client's call ends): a timeout, not a
    // lost worker or session.
    if (PastDeadline()) return Finish(grpc::Status(grpc::DEADLINE_EXCEEDED, "deadline passed"));
    const bool first_token_sent = !emitted_.empty();
    const bool lost_midstream =
        emitted_.size() > continued_from_ || (first_token_sent && st.error_code() == grpc::UNAVAILABLE);
    // A draining worker refuses new requests while its sessions move: an APPEND
    // that reached it before its session moved follows the session.
    const bool drain_refusal =
        st.error_code() == grpc::UNAVAILABLE && st.error_message() == kWorkerDrainingMessage;
    // A draining worker cut the stream at its --drain_deadline: the session kept
    // what was sent and moves on; it is not lost.
    const bool drain_cut =
        st.error_code() == grpc::UNAVAILABLE && st.error_message() == kStreamCutByDrainMessage;
    if (drain_refusal || drain_cut) router_->pool_->MarkDraining(placement_.worker);
    // A drain that cut the request before its first token (it was queued there)
    // is a refusal too.
    if (append_ && (drain_refusal || (drain_cut && emitted_.empty())) && !lost_midstream &&
        attempts_ < router_->options_.max_attempts) {
      KV_LOG_INFO("session '{}' is on draining worker {}; waiting for it to move", request_.session_id(),
                  placement_.worker);
      tried_.pop_back();  // the session may come back to no worker but this one's successor
      return NextAttempt();
    }
    // An APPEND that waited in the worker's queue while a migration (a drain, a
    // rebalance, an admin move) took its session away finds the session gone
    // there (NOT_FOUND). The move's events reach the directory on other Watch
    // streams, often after this reply: wait for the directory to show the
    // session elsewhere and follow it, instead of telling the client its
    // conversation does not exist. The wait blocks, so it runs on the executor.
    if (append_ && st.error_code() == grpc::NOT_FOUND && !lost_midstream &&
        attempts_ < router_->options_.max_attempts) {
      const WorkerId from = placement_.worker;
      const absl::Duration wait = router_->pool_->Draining(from) ? router_->options_.drain_move_wait
                                                                 : router_->options_.session_lookup_wait;
      if (router_->executor_.Schedule([this, from, wait] { FollowMovedSession(from, wait); })) return;
      return Finish(st);
    }
    // An APPEND its worker had no KV memory for (running requests and pinned
    // sessions hold that tier 0) moves with its session to a worker with room,
    // and runs there. Before, the client got RESOURCE_EXHAUSTED however much
    // room other workers had: a session that an admin drain left in a pinned
    // worker's host tier could not grow again while the pins stayed (qa26).
    // So does one whose context outgrew that worker's whole tier 0 (workers
    // of different sizes).
    const bool no_room = (st.error_code() == grpc::RESOURCE_EXHAUSTED &&
                          absl::StartsWith(st.error_message(), kNoKvMemoryMessage)) ||
                         (st.error_code() == grpc::OUT_OF_RANGE &&
                          absl::StartsWith(st.error_message(), kContextOverTier0Message));
    // A FULL_CONTEXT turn on a session there moves it too, so that the worker
    // it is retried on has the conversation's K/V (before, it computed them
    // all again, qa27).
    const bool session_there =
        append_ || (!request_.session_id().empty() &&
                    router_->directory_->FindSession({request_.tenant(), request_.session_id()})
                            .value_or(SessionLocation())
                            .worker == placement_.worker);
    // An APPEND cut out of room after tokens goes on where its session moves
    // (its worker kept the tokens sent; Attempt continues the reply there).
    // Before, the client got RESOURCE_EXHAUSTED in the middle of its reply.
    if (no_room && session_there && (!lost_midstream || append_) &&
        attempts_ < router_->options_.max_attempts) {
      const WorkerId from = placement_.worker;
      if (router_->executor_.Schedule([this, from] { MoveSessionForRoom(from); })) return;
      return Finish(st);
    }
    if (st.error_code() == grpc::UNAVAILABLE && !drain_refusal && !drain_cut)
      router_->pool_->MarkSuspect(placement_.worker);
    if (append_ && drain_cut) {
      // The drain moves the session with the tokens sent: follow it and go on
      // the reply there. Before, the client got UNAVAILABLE and had to send
      // an APPEND of its own.
      last_ =
          grpc::Status(grpc::UNAVAILABLE,
                       absl::StrCat("worker ", placement_.worker, " is draining and cut this stream after ",
                                    emitted_.size(), " tokens; session '", request_.session_id(),
                                    "' keeps them and moves to another worker: continue it with APPEND"));
      const WorkerId from = placement_.worker;
      const absl::Duration wait = router_->options_.drain_move_wait;
      if (attempts_ < router_->options_.max_attempts &&
          router_->executor_.Schedule([this, from, wait] { FollowMovedSession(from, wait); })) {
        return;
      }
      return Finish(last_);
    }
    // A worker that answers after tokens came with a status of its own (out of
    // room mid-reply, say) is there, and so is the session, with the tokens
    // sent: the client gets that status, not a loss. Before, it was told to
    // resend the whole conversation (qa25).
    if (append_ && lost_midstream && WorkerAnswered(st.error_code())) return Finish(st);
    if (append_ && (lost_midstream || st.error_code() == grpc::UNAVAILABLE)) {
      return Finish(grpc::Status(
          grpc::UNAVAILABLE,
          absl::StrCat("session '", request_.session_id(), "' was lost with worker ", placement_.worker, " (",
                       st.error_message(), "); resend the whole conversation with FULL_CONTEXT")));
    }
    if (!Retryable(st.error_code())) return Finish(st);
    KV_LOG_WARN("request on worker {} failed ({}); trying another worker", placement_.worker,
                st.error_message());
    NextAttempt();
  }

  // After `from` had no KV memory for this request: moves the session to a
  // worker with room for it and the request (its input and max_tokens; of a
  // reply cut after tokens, which the session holds with the input, what is
  // left of max_tokens), then follows it there; else an APPEND gets that
  // refusal, and a FULL_CONTEXT turn is retried elsewhere as any refused one.
  void MoveSessionForRoom(const WorkerId& from) {
    if (client_gone_.load()) return Finish(grpc::Status(grpc::CANCELLED, "client cancelled"));
    const SessionKey key{request_.tenant(), request_.session_id()};
    const bool cut = append_ && !emitted_.empty();
    const int64_t input = cut ? 0 : static_cast<int64_t>(tokens_.size());
    const int64_t reply =
        std::max<int64_t>(0, request_.sampling().max_tokens() - static_cast<int64_t>(emitted_.size()));
    absl::StatusOr<WorkerId> moved = router_->MoveForRoom(key, from, input, reply, append_);
    if (!append_) {
      if (moved.ok()) {
        // Placed once the directory shows it there (with its pages).
        router_->directory_->AwaitSessionOff(key, from, router_->options_.session_lookup_wait);
      } else {
        KV_LOG_INFO("session '{}' has no KV memory on {} and no worker took it: {}", request_.session_id(),
                    from, moved.status().ToString());
      }
      return NextAttempt();
    }
    // NOT_FOUND: the session left `from` meanwhile (a concurrent request on it
    // moved it, a drain): follow it, where that request's worker answers this
    // one (ABORTED while it runs), instead of saying there is no room.
    if (!moved.ok() && !absl::IsNotFound(moved.status())) {
      KV_LOG_INFO("session '{}' has no KV memory on {} and stays there: {}", request_.session_id(), from,
                  moved.status().ToString());
      return Finish(last_);
    }
    FollowMovedSession(from, router_->options_.session_lookup_wait, moved.ok() ? *moved : WorkerId());
  }

  // After `from` answered an APPEND NOT_FOUND: follows the session if the
  // directory shows it on another worker within `wait`; else the client gets
  // that NOT_FOUND (a session that is gone for good costs the client `wait`).
  // `moved_to`: the worker this router just moved the session to; if the
  // directory never shows it there, the session was lost with that worker.
  void FollowMovedSession(const WorkerId& from, absl::Duration wait, const WorkerId& moved_to = "") {
    if (client_gone_.load()) return Finish(grpc::Status(grpc::CANCELLED, "client cancelled"));
    const SessionKey key{request_.tenant(), request_.session_id()};
    std::optional<SessionLocation> loc = router_->directory_->AwaitSessionOff(key, from, wait);
    if (!loc.has_value() && !moved_to.empty()) {
      return Finish(ToGrpcStatus(Directory::LostError(key, moved_to)));
    }
    if (!loc.has_value()) {
      // A process restarted at the worker's address answers NOT_FOUND for what
      // the one before held: once its snapshot is in, the directory says so.
      std::optional<WorkerId> lost = router_->directory_->LostWith(key);
      return Finish(lost.has_value() ? ToGrpcStatus(Directory::LostError(key, *lost)) : last_);
    }
    if (loc->worker == from) return Finish(last_);
    KV_LOG_INFO("session '{}' moved from {} to {} while a request waited there; following it",
                request_.session_id(), from, loc->worker);
    tried_.pop_back();  // the session may come back to no worker but this one's successor
    NextAttempt();
  }

  // The client's deadline has passed, or is less than 100 ms away (see Finish).
  bool PastDeadline() const {
    constexpr auto kDeadlineSlack = std::chrono::milliseconds(100);
    return std::chrono::system_clock::now() + kDeadlineSlack >= deadline_;
  }

  // The proxy's last call: answers the client and lets go of the object and of
  // the service.
  void Finish(const grpc::Status& st) {
    // A client gone because its deadline passed counts as DEADLINE_EXCEEDED, so
    // that dashboards tell timeouts (an HTTP 504 among them) from clients that
    // left. The client's own timer cancels the call as its deadline passes,
    // which can be a moment before this copy of it (the wire carries the time
    // left, rounded up, and it counts from the call's arrival): hence the slack
    // (a clean-clone CI run counted one such timeout CANCELLED without it).
    const bool timed_out = st.error_code() == grpc::CANCELLED && client_gone_.load() && PastDeadline();
    router_->metrics_->OnRequestDone(timed_out ? CodeName(grpc::Status(grpc::DEADLINE_EXCEEDED, ""))
                                               : CodeName(st));
    Close(st);
    router_->EndCall();
    Unref();
  }

  // Client cancelled, its deadline passed, or a write failed: cancel the worker
  // call. TryCancel may run the call's callbacks inline, so it is called with no
  // lock held, on a reference that keeps the call alive.
  void OnClientGone() override {
    WorkerCall* call = nullptr;
    {
      absl::MutexLock lock(&mu_);
      client_gone_ = true;
      call = call_;
      if (call != nullptr) call->Ref();
    }
    if (call != nullptr) {
      call->Cancel();
      call->Unref();
    }
  }

  RouterService* const router_;
  v1::GenerateRequest request_;
  const std::chrono::system_clock::time_point deadline_;  // the client's
  const absl::Time start_;
  // The proxy's steps only (see the class comment).
  bool append_ = false;
  std::vector<int32_t> tokens_;   // the router's tokenisation of the input
  std::vector<int32_t> emitted_;  // tokens the client has been sent
  size_t continued_from_ = 0;     // tokens already streamed when the current attempt began
  // The usage of the attempt that began the stream, when its worker cut it
  // after tokens (kUsageTrailer) and another went on.
  std::optional<v1::Usage> opening_usage_;
  std::vector<WorkerId> tried_;
  int attempts_ = 0;
  Placement placement_;  // the current attempt's
  // Where the session was when this attempt moved it elsewhere, if it did.
  std::vector<WorkerId> stale_copies_;
  bool creates_session_ = false;  // this attempt makes the session on its worker (new, or moved)
  // The current attempt's entry in the router's DispatchLedger: its prompt's
  // page chain (empty unless placed by affinity), and its prompt tokens until
  // the first token arrives.
  std::vector<BlockHash> chain_;
  int64_t dispatched_prefill_ = 0;
  grpc::Status last_{grpc::UNAVAILABLE, "no healthy worker"};
  grpc::Status no_room_now_;  // the last RESOURCE_EXHAUSTED refusal, if any

  std::atomic<bool> client_gone_{false};
  absl::Mutex mu_;
  WorkerCall* call_ ABSL_GUARDED_BY(mu_) = nullptr;  // the attempt in flight, to cancel it
};

RouterService::RouterService(RouterOptions options, WorkerPool* pool, Directory* directory,
                             const tok::Tokenizer* tokenizer, const tok::ChatTemplate* chat_template,
                             const Authenticator* auth, RouterMetrics* metrics)
    : options_(options),
      pool_(pool),
      directory_(directory),
      tokenizer_(tokenizer),
      chat_template_(chat_template),
      auth_(auth),
      metrics_(metrics),
      executor_(std::max(1, options_.executor_threads), options_.executor_max_queued) {
  if (options_.rebalance_interval > absl::ZeroDuration()) {
    rebalancer_ = std::thread([this] {
      while (!stop_.WaitForNotificationWithTimeout(options_.rebalance_interval)) Rebalance();
    });
  }
  evacuator_ = std::thread([this] {
    while (!stop_.WaitForNotificationWithTimeout(options_.evacuate_interval)) {
      CloseListedStaleCopies();
      EvacuateDraining();
    }
  });
}

RouterService::~RouterService() { Shutdown(); }

void RouterService::Shutdown() {
  if (!stop_.HasBeenNotified()) stop_.Notify();
  if (rebalancer_.joinable()) rebalancer_.join();
  if (evacuator_.joinable()) evacuator_.join();
  {
    absl::MutexLock lock(&mu_);
    shutting_down_ = true;
    auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return calls_in_flight_ == 0; };
    mu_.Await(absl::Condition(&idle));
  }
  executor_.Shutdown();
}

void RouterService::RefuseNewCalls() {
  absl::MutexLock lock(&mu_);
  shutting_down_ = true;
}

bool RouterService::BeginCall() {
  absl::MutexLock lock(&mu_);
  if (shutting_down_) return false;
  ++calls_in_flight_;
  return true;
}

void RouterService::EndCall() {
  absl::MutexLock lock(&mu_);
  --calls_in_flight_;
}

std::vector<WorkerId> RouterService::SessionHomes(const SessionKey& key) const {
  std::vector<WorkerId> homes;
  if (auto recent = ledger_.RecentSessionWorker(key)) homes.push_back(*recent);
  if (auto loc = directory_->FindSession(key);
      loc.has_value() && (homes.empty() || homes[0] != loc->worker)) {
    homes.push_back(loc->worker);
  }
  return homes;
}

bool RouterService::MustWaitForSession(const SessionKey& key) const {
  // Place sends it after that request, unless its worker drains (the session
  // moves off it: before, this request then found it there, not available,
  // and its client was told to resend the conversation, qa33).
  if (auto busy = ledger_.SessionWorker(key); busy.has_value() && !pool_->Draining(*busy)) return false;
  auto loc = directory_->FindSession(key);
  return !loc.has_value() || pool_->Draining(loc->worker);
}

absl::StatusOr<Placement> RouterService::Place(const std::string& session_id, const std::string& tenant,
                                               bool append, const std::vector<int32_t>& tokens,
                                               int64_t reply_tokens, const std::vector<WorkerId>& exclude,
                                               absl::Duration wait, std::vector<BlockHash>* chain_out) {
  if (chain_out != nullptr) chain_out->clear();
  std::vector<WorkerView> healthy = pool_->Healthy();
  auto excluded = [&exclude](const WorkerId& w) {
    return std::find(exclude.begin(), exclude.end(), w) != exclude.end();
  };
  // Sessions are the tenant's own: another tenant's session by this id is not
  // found, exactly like one that never existed.
  const SessionKey session{tenant, session_id};
  // A request on the session is in flight through this router: this one goes
  // to the same worker, in every placement mode (see DispatchLedger).
  if (!session_id.empty()) {
    if (std::optional<std::string> busy = ledger_.SessionWorker(session); busy && !excluded(*busy)) {
      for (const WorkerView& w : healthy) {
        if (w.address == *busy) return Placement{w.address, PlacementReason::kAffinity, 0, 0};
      }
    }
  }
  std::optional<SessionLocation> loc;
  if (append) {
    auto found = directory_->Lookup(session, wait);
    if (!found.ok()) return found.status();
    loc = *std::move(found);
    // Its worker drains: the session is being migrated; follow it (a caller
    // that may block passes a wait). A draining worker that is gone moves
    // nothing more: wait only for the events of moves it made, which may
    // trail the end of its stream.
    if (wait > absl::ZeroDuration() && pool_->Draining(loc->worker)) {
      const WorkerId from = loc->worker;
      const std::optional<WorkerView> view = pool_->Find(from);
      const absl::Duration move_wait =
          view.has_value() && view->connected ? options_.drain_move_wait : options_.session_lookup_wait;
      auto moved = directory_->AwaitSessionOff(session, from, move_wait);
      if (!moved.has_value()) {
        if (std::optional<WorkerId> lost = directory_->LostWith(session)) {
          return Directory::LostError(session, *lost);
        }
        return absl::NotFoundError(absl::StrCat("session '", session_id, "' not found"));
      }
      loc = *std::move(moved);
      healthy = pool_->Healthy();
      // Still there after the wait: a request on it there holds it (the drain
      // moves it once that request ends, or is cut at the drain's deadline),
      // or the move is under way. This one is ABORTED as on any busy session.
      // Before, it was told the session was not available and to resend it
      // with FULL_CONTEXT, which made a second copy and cut the running
      // request short (qa34).
      if (loc->worker == from && SessionBusyOn(session, *loc, /*moving_counts=*/true)) {
        return absl::AbortedError(BusyOnDrainingWorker(session_id, from));
      }
    }
  } else if (!session_id.empty()) {
    loc = directory_->FindSession(session);
  }
  if (append) {
    for (const WorkerView& w : healthy) {
      if (w.address == loc->worker && !excluded(w.address)) {
        return Placement{w.address, PlacementReason::kAffinity, loc->tokens, 0};
      }
    }
    return absl::UnavailableError(absl::StrCat("session '", session_id, "' lives on worker ", loc->worker,
                                               ", which is not available; resend it with FULL_CONTEXT"));
  }
  std::vector<WorkerView> cands;
  for (WorkerView& w : healthy) {
    // A worker that left DNS serves its own sessions, takes no new ones.
    if (!excluded(w.address) && !w.departed) cands.push_back(std::move(w));
  }
  if (cands.empty()) return absl::UnavailableError("no healthy worker can take the request");
  if (options_.mode == PlacementMode::kRoundRobin) {
    const auto& w = cands[round_robin_.fetch_add(1) % cands.size()];
    return Placement{w.address, PlacementReason::kLoad, 0, 0};
  }
  if (options_.mode == PlacementMode::kRandom) {
    absl::MutexLock lock(&mu_);
    const auto& w = cands[rng_() % cands.size()];
    return Placement{w.address, PlacementReason::kLoad, 0, 0};
  }
  // Affinity: prefix hashes with the model id and page size the workers report.
  const int page_tokens =
      cands.front().kv_shape.page_tokens() > 0 ? cands.front().kv_shape.page_tokens() : 16;
  std::vector<BlockHash> chain = ChainBlockHashes(tokens, page_tokens, cands.front().model_id, tenant);
  const auto matches = directory_->MatchPrefix(chain);
  const int64_t context_pages =
      (static_cast<int64_t>(tokens.size()) + std::max<int64_t>(0, reply_tokens) + page_tokens - 1) /
      page_tokens;
  // A session this router is creating counts as the ledger's until the
  // directory lists it there, then as the directory's: once, either way. The
  // ledger lets go of those listed before the directory's count is read, so
  // that one listed in between counts twice for a moment, never not at all.
  for (const WorkerView& w : cands) {
    for (const SessionKey& s : ledger_.Creations(w.address)) {
      if (auto l = directory_->FindSession(s); l.has_value() && l->worker == w.address) {
        ledger_.Listed(s, w.address);
      }
    }
  }
  const auto session_counts = directory_->SessionCounts();
  std::vector<Candidate> candidates;
  for (const WorkerView& w : cands) {
    Candidate c;
    c.worker = w.address;
    c.load = w.load;
    const DispatchLedger::Outstanding out = ledger_.Get(w.address);
    c.dispatched_requests = out.requests;
    c.dispatched_prefill_tokens = out.prefill_tokens;
    auto m = matches.find(w.address);
    if (m != matches.end()) c.match = m->second;
    // Pages a request in flight there is computing count as cached: they will
    // be by the time this one's prefill reaches them.
    const int computing = ledger_.LeadingPages(w.address, chain);
    if (computing > c.match.total_pages()) c.match = PrefixMatch{computing, 0};
    c.sessions = out.new_sessions;
    if (auto n = session_counts.find(w.address); n != session_counts.end()) c.sessions += n->second;
    c.holds_context = w.load.pages_total_device() <= 0 || context_pages <= w.load.pages_total_device();
    candidates.push_back(std::move(c));
  }
  // Ties among equals go by rendezvous of the session id (or the prompt's start).
  const std::string key =
      session_id.empty()
          ? absl::StrJoin(tokens.begin(), tokens.begin() + std::min<size_t>(tokens.size(), 64), ",")
          : session_id;
  const int request_pages = static_cast<int>((tokens.size() + page_tokens - 1) / page_tokens);
  // A named session stays where it is placed, so its placement is bounded by
  // the sessions each worker holds as well as by its queue.
  auto placed = Choose(options_.placement, key, loc.has_value() ? loc->worker : WorkerId(), page_tokens,
                       request_pages, /*new_session=*/!session_id.empty(), candidates, /*retry=*/false);
  if (placed.ok() && chain_out != nullptr) *chain_out = std::move(chain);
  return placed;
}

grpc::ServerWriteReactor<v1::GenerateResponse>* RouterService::Generate(grpc::CallbackServerContext* context,
                                                                        const v1::GenerateRequest* request) {
  auto* reactor = new ProxyReactor(this, *request, context->deadline());
  if (!BeginCall()) {
    reactor->Close(grpc::Status(grpc::UNAVAILABLE, "router is shutting down"));
    return reactor;
  }
  reactor->Ref();  // the proxy's; its Finish drops it after its last call
  reactor->Start(*context);
  return reactor;
}

namespace {

// A worker method through gRPC's callback API, e.g.
// &v1::Worker::StubInterface::async_interface::GetSession.
template <typename Req, typename Resp>
using AsyncUnary = void (v1::Worker::StubInterface::async_interface::*)(grpc::ClientContext*, const Req*,
                                                                        Resp*,
                                                                        std::function<void(grpc::Status)>);

// One unary call to a worker through the callback API: no thread waits for the
// answer. `done(status, response)` runs once, on a gRPC thread. What the call
// needs lives on the heap until then.
template <typename Req, typename Resp>
void CallWorker(std::shared_ptr<grpc::Channel> channel, std::chrono::system_clock::time_point deadline,
                AsyncUnary<Req, Resp> method, Req request,
                absl::AnyInvocable<void(const grpc::Status&, Resp*) &&> done) {
  struct Call {
    std::unique_ptr<v1::Worker::Stub> stub;
    grpc::ClientContext ctx;
    Req request;
    Resp response;
    absl::AnyInvocable<void(const grpc::Status&, Resp*) &&> done;
  };
  auto* call = new Call{v1::Worker::NewStub(channel), {}, std::move(request), {}, std::move(done)};
  call->ctx.set_deadline(deadline);
  (call->stub->async()->*method)(&call->ctx, &call->request, &call->response, [call](grpc::Status st) {
    std::move(call->done)(st, &call->response);
    delete call;
  });
}

}  // namespace

void RouterService::CloseStaleCopy(const SessionKey& key, const WorkerId& worker) {
  auto channel = pool_->Channel(worker);
  if (channel == nullptr) return;  // gone with its worker
  // Counted as a call, so that Shutdown waits for the answer that the
  // directory is told.
  if (!BeginCall()) return;
  v1::SessionRequest req;
  req.set_session_id(key.session_id);
  req.set_tenant(key.tenant);
  KV_LOG_INFO("session '{}' moved off worker {} by a FULL_CONTEXT turn; closing the copy there",
              key.session_id, worker);
  CallWorker<v1::SessionRequest, v1::CloseSessionResponse>(
      std::move(channel), std::chrono::system_clock::now() + std::chrono::seconds(5),
      &v1::Worker::StubInterface::async_interface::CloseSession, std::move(req),
      [this, key, worker](const grpc::Status& st, v1::CloseSessionResponse*) {
        if (st.ok() || st.error_code() == grpc::NOT_FOUND) {
          directory_->ClearStale(key, worker);
        } else if (st.error_code() == grpc::UNAVAILABLE || st.error_code() == grpc::DEADLINE_EXCEEDED) {
          // Out of reach (hung, partitioned): the copy must not be taken for
          // the session if the worker comes back with it; the directory holds
          // it back and lists it for CloseListedStaleCopies when the worker
          // does.
          directory_->MarkStale(key, worker);
          KV_LOG_WARN(
              "closing the stale copy of session '{}' on {} failed: {}; it is held back and closed "
              "when the worker is back",
              key.session_id, worker, st.error_message());
        } else {
          KV_LOG_WARN("closing the stale copy of session '{}' on {} failed: {}", key.session_id, worker,
                      st.error_message());
        }
        EndCall();
      });
}

// One session call (GetSession, CloseSession, ForkSession, PinSession) on the
// worker that holds the session, as the client call's reactor: a client that
// cancels cancels the worker call. It deletes itself once gRPC is done with it
// (OnDone) and it has answered (Answer).
template <typename Req, typename Resp>
class RouterService::SessionForward final : public grpc::ServerUnaryReactor {
 public:
  SessionForward(RouterService* router, AsyncUnary<Req, Resp> method, Req request, Resp* response,
                 std::chrono::system_clock::time_point deadline)
      : router_(router), method_(method), request_(std::move(request)), response_(response) {
    ctx_.set_deadline(deadline);
  }

  // REQUIRES: the caller counted the call (BeginCall()); Answer ends it.
  void Start() {
    // A malformed id names no session: INVALID_ARGUMENT, as the worker says.
    if (absl::Status st = ValidateSessionId(request_.session_id()); !st.ok()) return Answer(ToGrpcStatus(st));
    // A fork's new id must be free in the whole fleet, not only on the worker
    // that holds the source (which checks its own sessions).
    if constexpr (std::is_same_v<Req, v1::ForkSessionRequest>) {
      if (absl::Status st = ValidateSessionId(request_.new_session_id()); !st.ok())
        return Answer(ToGrpcStatus(st));
      if (!router_->SessionHomes({request_.tenant(), request_.new_session_id()}).empty()) {
        return Answer(grpc::Status(grpc::ALREADY_EXISTS,
                                   absl::StrCat("session '", request_.new_session_id(), "' already exists")));
      }
    }
    // The caller's own session only (the request carries its tenant).
    const SessionKey key{request_.tenant(), request_.session_id()};
    auto loc = router_->directory_->Lookup(key, absl::ZeroDuration());
    if (loc.ok()) return Forward(loc);
    // Not known yet: the worker's placement event may trail the reply that
    // created the session. Waiting for it blocks, so it runs on the executor.
    const bool queued = router_->executor_.Schedule(
        [this, key] { Forward(router_->directory_->Lookup(key, router_->options_.session_lookup_wait)); });
    if (!queued) Answer(grpc::Status(grpc::RESOURCE_EXHAUSTED, "the router is overloaded; retry later"));
  }

  void OnCancel() override { ctx_.TryCancel(); }  // before the call starts, it never starts
  void OnDone() override { Unref(); }

 private:
  void Forward(const absl::StatusOr<SessionLocation>& loc) {
    if (!loc.ok()) return Answer(ToGrpcStatus(loc.status()));
    auto channel = router_->pool_->Channel(loc->worker);
    if (channel == nullptr) {  // its worker left the pool since: the session is gone with it
      return Answer(
          grpc::Status(grpc::NOT_FOUND, absl::StrCat("session '", request_.session_id(), "' not found")));
    }
    stub_ = v1::Worker::NewStub(channel);
    (stub_->async()->*method_)(&ctx_, &request_, response_, [this, worker = loc->worker](grpc::Status st) {
      // The transport's words alone ("failed to connect to all addresses") do
      // not say which session's worker is gone, or what the client can do.
      if (st.error_code() == grpc::UNAVAILABLE && st.error_message() != kWorkerDrainingMessage) {
        st = grpc::Status(grpc::UNAVAILABLE,
                          absl::StrCat("worker ", worker, " holding session '", request_.session_id(),
                                       "' is not reachable (", st.error_message(),
                                       "); if it was lost, so was the session: resend the whole "
                                       "conversation with FULL_CONTEXT"));
      }
      if constexpr (std::is_same_v<Resp, v1::CloseSessionResponse>) {
        if (st.ok()) router_->ledger_.SessionClosed({request_.tenant(), request_.session_id()});
      }
      Answer(st);
    });
  }

  void Answer(const grpc::Status& st) {
    RouterService* const router = router_;
    Finish(st);
    router->EndCall();
    Unref();
  }

  void Unref() {
    if (refs_.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
  }

  RouterService* const router_;
  const AsyncUnary<Req, Resp> method_;
  const Req request_;
  Resp* const response_;  // gRPC's, valid until Finish
  std::unique_ptr<v1::Worker::Stub> stub_;
  grpc::ClientContext ctx_;
  std::atomic<int> refs_{2};  // gRPC's (until OnDone) and the forward's (until Answer)
};

#define KVCACHE_FORWARD_TO_SESSION(METHOD, REQ_TYPE, RESP_TYPE)                                   \
  grpc::ServerUnaryReactor* RouterService::METHOD(grpc::CallbackServerContext* context,           \
                                                  const REQ_TYPE* request, RESP_TYPE* response) { \
    auto principal = auth_->Authenticate(*context, false);                                        \
    if (!principal.ok() || !BeginCall()) {                                                        \
      grpc::ServerUnaryReactor* reactor = context->DefaultReactor();                              \
      reactor->Finish(principal.ok() ? grpc::Status(grpc::UNAVAILABLE, "router is shutting down") \
                                     : ToGrpcStatus(principal.status()));                         \
      return reactor;                                                                             \
    }                                                                                             \
    REQ_TYPE req = *request;                                                                      \
    req.set_tenant(principal->tenant);                                                            \
    auto* reactor = new SessionForward<REQ_TYPE, RESP_TYPE>(                                      \
        this, &v1::Worker::StubInterface::async_interface::METHOD, std::move(req), response,      \
        DeadlineFor(context, absl::Seconds(60)));                                                 \
    reactor->Start();                                                                             \
    return reactor;                                                                               \
  }

KVCACHE_FORWARD_TO_SESSION(GetSession, v1::SessionRequest, v1::SessionInfo)
KVCACHE_FORWARD_TO_SESSION(CloseSession, v1::SessionRequest, v1::CloseSessionResponse)
KVCACHE_FORWARD_TO_SESSION(ForkSession, v1::ForkSessionRequest, v1::SessionInfo)
KVCACHE_FORWARD_TO_SESSION(PinSession, v1::PinSessionRequest, v1::SessionInfo)
#undef KVCACHE_FORWARD_TO_SESSION

grpc::ServerUnaryReactor* RouterService::ListSessions(grpc::CallbackServerContext* context,
                                                      const v1::ListSessionsRequest* /*request*/,
                                                      v1::ListSessionsResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  auto principal = auth_->Authenticate(*context, false);
  if (!principal.ok()) {
    reactor->Finish(ToGrpcStatus(principal.status()));
    return reactor;
  }
  if (!BeginCall()) {
    reactor->Finish(grpc::Status(grpc::UNAVAILABLE, "router is shutting down"));
    return reactor;
  }
  // Asks every connected worker at once; the last answer (the last reference
  // to `gather`) finishes the call. A worker that fails is left out, as before.
  struct Gather {
    RouterService* router;
    grpc::ServerUnaryReactor* reactor;
    absl::Mutex mu;
    v1::ListSessionsResponse* response ABSL_PT_GUARDED_BY(mu);
    ~Gather() {
      reactor->Finish(grpc::Status::OK);
      router->EndCall();
    }
  };
  auto gather = std::make_shared<Gather>();
  gather->router = this;
  gather->reactor = reactor;
  gather->response = response;
  const auto deadline = DeadlineFor(context, absl::Seconds(10));
  for (const WorkerView& w : pool_->Workers()) {
    if (!w.connected) continue;
    auto channel = pool_->Channel(w.address);
    if (channel == nullptr) continue;
    v1::ListSessionsRequest req;
    req.set_tenant(principal->tenant);
    CallWorker<v1::ListSessionsRequest, v1::ListSessionsResponse>(
        std::move(channel), deadline, &v1::Worker::StubInterface::async_interface::ListSessions,
        std::move(req), [gather](const grpc::Status& st, v1::ListSessionsResponse* part) {
          if (!st.ok()) return;
          absl::MutexLock lock(&gather->mu);
          for (auto& s : *part->mutable_sessions()) *gather->response->add_sessions() = std::move(s);
        });
  }
  return reactor;
}

absl::StatusOr<v1::ListWorkersResponse> RouterService::ListWorkers() const {
  v1::ListWorkersResponse out;
  for (const WorkerView& w : pool_->Workers()) {
    v1::WorkerInfo* info = out.add_workers();
    info->set_worker_id(w.worker_id);
    info->set_address(w.address);
    info->set_health(!w.connected    ? "DOWN"
                     : w.wrong_model ? "WRONG_MODEL"
                     : w.draining    ? "DRAINING"
                     : w.healthy     ? "SERVING"
                                     : "NOT_SERVING");
    *info->mutable_load() = w.load;
    info->set_sessions(static_cast<int32_t>(directory_->SessionsOn(w.address).size()));
    info->set_model_id(w.model_id);
  }
  return out;
}

void RouterService::MigrateByIdAsync(const std::string& session_id, const std::string& target,
                                     Done<v1::MigrateSessionResponse> done) {
  if (absl::Status st = ValidateSessionId(session_id); !st.ok()) return std::move(done)(st);
  const std::vector<SessionLocation> named = directory_->SessionsNamed(session_id);
  if (named.size() == 1) return MigrateAsync(named.front().key(), target, "admin", std::move(done));
  // A session this router has just served may not have reached the directory
  // yet: wait for its worker's placement event as a tenant's own call on it
  // would (blocking, so on the executor).
  const std::vector<SessionKey> recent =
      named.empty() ? ledger_.RecentSessionsNamed(session_id) : std::vector<SessionKey>();
  const size_t tenants = std::max(named.size(), recent.size());
  if (tenants == 0) {
    return std::move(done)(absl::NotFoundError(absl::StrCat("session '", session_id, "' not found")));
  }
  if (tenants > 1) {
    return std::move(done)(
        absl::FailedPreconditionError(absl::StrCat("session id '", session_id, "' is used by ", tenants,
                                                   " tenants; the admin API cannot tell which one to move")));
  }
  auto pending = std::make_shared<Done<v1::MigrateSessionResponse>>(std::move(done));
  const bool queued = executor_.Schedule([this, key = recent.front(), target, pending] {
    directory_->AwaitSession(key, options_.session_lookup_wait);
    MigrateAsync(key, target, "admin", std::move(*pending));
  });
  if (!queued) {
    Done<v1::MigrateSessionResponse> refused = std::move(*pending);
    std::move(refused)(absl::ResourceExhaustedError("the router is overloaded; retry later"));
  }
}

absl::StatusOr<WorkerId> RouterService::MoveTarget(const SessionLocation& loc, int64_t grow_tokens,
                                                   bool need_room, const std::vector<WorkerId>& refused) {
  // The session's context must fit the target's tier 0. Workers whose free
  // device pages hold it twice over (itself and room to grow) come first, then
  // those that hold it once, then those that would hold it once they offload
  // idle sessions (pages not held, WorkerLoad.pages_held_device): another
  // would stage it in its host tier, where it waits for room to be restored,
  // or refuse it. The placement's session and load caps alone sent sessions to
  // a worker whose pins left them no room to run (qa26). Before the third
  // tier, a fleet whose tier 0s were full of idle sessions (a cache's steady
  // state) had no worker with room for a move.
  const int64_t tokens = loc.tokens + grow_tokens;
  std::vector<WorkerId> exclude = {loc.worker};
  struct Other {
    WorkerId worker;
    int64_t free_fits;  // times the free pages hold the session
    bool reclaimable;   // the pages not held hold it
  };
  std::vector<Other> others;
  for (const WorkerView& w : pool_->Healthy()) {
    if (w.address == loc.worker) continue;
    if (absl::c_linear_search(refused, w.address)) {
      exclude.push_back(w.address);
      continue;
    }
    const int32_t page_tokens = w.kv_shape.page_tokens();
    const int64_t pages = page_tokens > 0 ? (tokens + page_tokens - 1) / page_tokens : 0;
    const int64_t total = w.load.pages_total_device();
    if (pages == 0 || total <= 0) {  // its shape or load not known yet
      others.push_back({w.address, 2, true});
      continue;
    }
    others.push_back(
        {w.address, w.load.pages_free_device() / pages, total - w.load.pages_held_device() >= pages});
  }
  using Fits = std::function<bool(const Other&)>;
  const Fits tiers[] = {[](const Other& o) { return o.free_fits >= 2; },
                        [](const Other& o) { return o.free_fits >= 1; },
                        [](const Other& o) { return o.reclaimable; }};
  bool roomy = false;
  for (const Fits& fits : tiers) {
    if (absl::c_none_of(others, fits)) continue;
    for (const Other& o : others) {
      if (!fits(o)) exclude.push_back(o.worker);
    }
    roomy = true;
    break;
  }
  if (need_room && !roomy) {
    return absl::ResourceExhaustedError(
        absl::StrCat("no other worker has device pages to spare for session '", loc.session_id, "' (", tokens,
                     " tokens)"));
  }
  auto p = Place(loc.session_id, loc.tenant, false, {}, tokens, exclude);
  if (!p.ok()) {
    return absl::UnavailableError(
        absl::StrCat("no other worker can take session '", loc.session_id, "': ", p.status().message()));
  }
  return p->worker;
}

absl::StatusOr<WorkerId> RouterService::MoveForRoom(const SessionKey& key, const WorkerId& from,
                                                    int64_t input_tokens, int64_t reply_tokens,
                                                    bool appends) {
  std::optional<SessionLocation> loc = directory_->FindSession(key);
  if (loc.has_value() && loc->worker == from) {
    // Its length, noted in the directory (a direct client or another router
    // may have grown it).
    const bool gone = absl::IsNotFound(AskSession(*loc).status());  // from `from`, meanwhile
    loc = gone ? std::nullopt : directory_->FindSession(key);
  }
  if (!loc.has_value()) return absl::NotFoundError(absl::StrCat("session '", key.session_id, "' not found"));
  if (loc->worker != from) return loc->worker;  // moved meanwhile
  // An APPEND's input follows the session's tokens; a FULL_CONTEXT input is the
  // whole context, of which the session holds a prefix.
  const int64_t context = appends ? loc->tokens + input_tokens : std::max<int64_t>(loc->tokens, input_tokens);
  const int64_t grow_tokens = context + reply_tokens - loc->tokens;
  // A target that refuses (it began draining, or its room went meanwhile)
  // leaves the session where it was: the next one with room is tried. Before,
  // the first refusal ended the move, and the client was told there was no
  // room while another worker had it (qa28).
  WorkerId dest;
  absl::StatusOr<v1::MigrateSessionResponse> moved =
      MoveToPicked(*loc, "room", grow_tokens, /*need_room=*/true, &dest);
  if (!moved.ok()) return moved.status();
  KV_LOG_INFO("session '{}' ({} tokens) had no KV memory on {} for {} more: moved it to {}", key.session_id,
              loc->tokens, from, grow_tokens, dest);
  return dest;
}

std::optional<SessionLocation> RouterService::LocateForMove(const SessionKey& key,
                                                            const WorkerId& source) const {
  std::optional<SessionLocation> loc = directory_->FindSession(key);
  if (!source.empty()) {
    if (!loc.has_value()) loc = SessionLocation{key.session_id, source, v1::TIER_DEVICE, 0, key.tenant};
    loc->worker = source;
  }
  return loc;
}

void RouterService::MigrateAsync(const SessionKey& key, const std::string& target, const char* reason,
                                 Done<v1::MigrateSessionResponse> done, const WorkerId& source) {
  const std::string& session_id = key.session_id;
  std::optional<SessionLocation> loc = LocateForMove(key, source);
  if (!loc.has_value()) {
    return std::move(done)(absl::NotFoundError(absl::StrCat("session '", session_id, "' not found")));
  }
  if (target.empty()) {
    // Picking may take several moves, each waited for: on the executor.
    auto pending = std::make_shared<Done<v1::MigrateSessionResponse>>(std::move(done));
    const bool queued = executor_.Schedule([this, key, reason, source = loc->worker, pending] {
      std::move (*pending)(MigrateToPicked(key, reason, source));
    });
    if (!queued) {
      Done<v1::MigrateSessionResponse> refused = std::move(*pending);
      std::move(refused)(absl::ResourceExhaustedError("the router is overloaded; retry later"));
    }
    return;
  }
  auto w = pool_->Find(target);
  if (!w.has_value())
    return std::move(done)(absl::NotFoundError(absl::StrCat("worker '", target, "' not found")));
  if (!w->healthy) {
    return std::move(done)(
        absl::FailedPreconditionError(absl::StrCat("worker '", target, "' is not healthy")));
  }
  const WorkerId dest = w->address;
  if (dest == loc->worker) {
    return std::move(done)(absl::FailedPreconditionError("the session already lives on that worker"));
  }
  auto channel = pool_->Channel(loc->worker);
  if (channel == nullptr) {
    return std::move(done)(absl::UnavailableError(absl::StrCat("worker ", loc->worker, " is gone")));
  }
  if (!BeginCall()) return std::move(done)(absl::UnavailableError("router is shutting down"));
  v1::MigrateSessionRequest req;
  req.set_session_id(session_id);
  req.set_target_address(dest);
  req.set_tenant(loc->tenant);
  CallWorker<v1::MigrateSessionRequest, v1::MigrateSessionResponse>(
      std::move(channel), std::chrono::system_clock::now() + std::chrono::minutes(5),
      &v1::Worker::StubInterface::async_interface::MigrateSession, std::move(req),
      [this, key, dest, reason, done = std::move(done)](const grpc::Status& st,
                                                        v1::MigrateSessionResponse* resp) mutable {
        if (st.ok()) {
          // Where this router last saw the session is stale now: a FULL_CONTEXT
          // turn must not take the worker it left for one holding a copy.
          ledger_.SessionMoved(key, dest);
          metrics_->OnMigration(reason);
          std::move(done)(std::move(*resp));
        } else {
          std::move(done)(FromGrpcStatus(st));
        }
        EndCall();
      });
}

absl::StatusOr<v1::MigrateSessionResponse> RouterService::Migrate(const SessionKey& key,
                                                                  const std::string& target,
                                                                  const char* reason,
                                                                  const WorkerId& source) {
  if (target.empty()) return MigrateToPicked(key, reason, source);
  absl::Notification answered;
  absl::StatusOr<v1::MigrateSessionResponse> result;
  MigrateAsync(
      key, target, reason,
      [&](absl::StatusOr<v1::MigrateSessionResponse> r) {
        result = std::move(r);
        answered.Notify();
      },
      source);
  answered.WaitForNotification();
  return result;
}

absl::StatusOr<v1::MigrateSessionResponse> RouterService::MigrateToPicked(const SessionKey& key,
                                                                          const char* reason,
                                                                          const WorkerId& source) {
  std::optional<SessionLocation> loc = LocateForMove(key, source);
  if (!loc.has_value()) return absl::NotFoundError(absl::StrCat("session '", key.session_id, "' not found"));
  // Before up to three were tried (MoveToPicked), the first refusal ended an
  // admin move or a drain's, while another worker could take the session (qa31).
  WorkerId unused;
  return MoveToPicked(*loc, reason, 0, /*need_room=*/false, &unused);
}

absl::StatusOr<v1::MigrateSessionResponse> RouterService::MoveToPicked(const SessionLocation& loc,
                                                                       const char* reason,
                                                                       int64_t grow_tokens, bool need_room,
                                                                       WorkerId* to) {
  // A worker that refuses the session (its pin quota, it began draining, its
  // room went) leaves it where it was, and the next is tried.
  std::vector<WorkerId> refused;
  absl::Status last;
  for (int i = 0; i < kMaxMoveTargets; ++i) {
    absl::StatusOr<WorkerId> dest = MoveTarget(loc, grow_tokens, need_room, refused);
    if (!dest.ok()) return last.ok() ? dest.status() : last;
    // From loc.worker, whatever the directory shows: a target that refused the
    // session after committing it announced it placed, then dropped, and the
    // directory may show it there meanwhile.
    absl::StatusOr<v1::MigrateSessionResponse> moved = Migrate(loc.key(), *dest, reason, loc.worker);
    if (moved.ok()) {
      *to = *dest;
      return moved;
    }
    // Another request's move (or a drain) took the session meanwhile: the
    // migration then fails NOT_FOUND, or FAILED_PRECONDITION when the session
    // left during the export. A caller may follow it.
    if (absl::IsNotFound(AskSession(loc).status())) {
      return absl::NotFoundError(
          absl::StrCat("session '", loc.session_id, "' left ", loc.worker, " meanwhile"));
    }
    KV_LOG_INFO("session '{}' ({}) did not move from {} to {}: {}", loc.session_id, reason, loc.worker, *dest,
                moved.status().ToString());
    refused.push_back(*dest);
    last = moved.status();
  }
  return last;
}

void RouterService::DrainWorkerAsync(const std::string& worker, int32_t deadline_ms,
                                     Done<v1::DrainResponse> done) {
  auto w = pool_->Find(worker);
  if (!w.has_value())
    return std::move(done)(absl::NotFoundError(absl::StrCat("worker '", worker, "' not found")));
  pool_->SetDraining(w->address);
  v1::DrainRequest req;
  for (const WorkerView& other : pool_->Healthy()) {
    if (other.address != w->address) req.add_targets(other.address);
  }
  req.set_deadline_ms(deadline_ms);
  auto channel = pool_->Channel(w->address);
  if (channel == nullptr) return std::move(done)(absl::UnavailableError("worker is gone"));
  if (!BeginCall()) return std::move(done)(absl::UnavailableError("router is shutting down"));
  CallWorker<v1::DrainRequest, v1::DrainResponse>(
      std::move(channel), std::chrono::system_clock::now() + std::chrono::minutes(10),
      &v1::Worker::StubInterface::async_interface::Drain, std::move(req),
      [this, address = w->address, done = std::move(done)](const grpc::Status& st,
                                                           v1::DrainResponse* resp) mutable {
        // What the worker could not move (its targets had no room then), the
        // evacuator moves while the worker waits for its sessions to leave.
        // Before, it left them there and they ended with the process.
        pool_->EndAdminDrain(address);
        if (st.ok()) {
          for (int i = 0; i < resp->sessions_migrated(); ++i) metrics_->OnMigration("drain");
          std::move(done)(std::move(*resp));
        } else {
          std::move(done)(FromGrpcStatus(st));
        }
        EndCall();
      });
}

void RouterService::CloseListedStaleCopies() {
  for (auto& [key, worker] : directory_->TakeStaleCopies()) CloseStaleCopy(key, worker);
}

bool RouterService::SessionBusyOn(const SessionKey& key, const SessionLocation& loc, bool moving_counts) {
  if (ledger_.SessionWorker(key) == loc.worker) return true;  // this router's request
  absl::StatusOr<v1::SessionInfo> info = AskSession(loc);     // another router's, or a direct client's
  return info.ok() &&
         (info->state() == v1::SESSION_RUNNING || (moving_counts && info->state() == v1::SESSION_MIGRATING));
}

std::optional<SessionLocation> RouterService::DrainingHome(const SessionKey& key) const {
  if (std::optional<WorkerId> busy = ledger_.SessionWorker(key); busy.has_value() && pool_->Draining(*busy)) {
    return SessionLocation{key.session_id, *busy, v1::TIER_DEVICE, 0, key.tenant};
  }
  std::optional<SessionLocation> loc = directory_->FindSession(key);
  if (loc.has_value() && pool_->Draining(loc->worker)) return loc;
  return std::nullopt;
}

absl::StatusOr<v1::SessionInfo> RouterService::AskSession(const SessionLocation& s) {
  auto channel = pool_->Channel(s.worker);
  if (channel == nullptr) return absl::UnavailableError(absl::StrCat("worker ", s.worker, " is gone"));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
  v1::SessionRequest req;
  req.set_session_id(s.session_id);
  req.set_tenant(s.tenant);
  v1::SessionInfo info;
  if (grpc::Status st = v1::Worker::NewStub(channel)->GetSession(&ctx, req, &info); !st.ok()) {
    return FromGrpcStatus(st);
  }
  // Its length: K/V that memory pressure dropped counts too (the target
  // computes it again). Before, a move after such a drop was sized on the
  // cached tokens alone and went to a worker that could not hold it (qa34).
  directory_->NoteSessionTokens(s.key(), s.worker, std::max(info.tokens_cached(), info.context_tokens()));
  return info;
}

void RouterService::EvacuateDraining() {
  // A running session's move waits for its stream to end (or to be cut at the
  // drain deadline), so the idle sessions of every draining worker move first.
  // Before, the idle sessions after a running one in the directory's order
  // waited for its cut, and those the rest of the deadline could not move were
  // lost with the worker (qa27: 7 of 30).
  std::vector<SessionLocation> running;
  auto move = [this](const SessionLocation& s) {
    auto r = Migrate(s.key(), "", "drain");
    if (r.ok()) {
      KV_LOG_INFO("worker {} is draining: moved session '{}' to {}", s.worker, s.session_id,
                  r->session().worker_id());
    } else {
      KV_LOG_WARN("worker {} is draining: could not move session '{}': {}", s.worker, s.session_id,
                  r.status().ToString());
    }
  };
  for (const WorkerView& w : pool_->Workers()) {
    // An admin drain moves its own sessions (worker Drain with targets) until
    // its call ends.
    if (!w.connected || !w.draining || w.admin_draining) continue;
    for (const SessionLocation& s : directory_->SessionsOn(w.address)) {
      absl::StatusOr<v1::SessionInfo> info = AskSession(s);
      if (info.ok() && info->state() == v1::SESSION_RUNNING) {
        running.push_back(s);
      } else {
        move(s);
      }
    }
  }
  for (const SessionLocation& s : running) move(s);
}

void RouterService::Rebalance() {
  std::vector<WorkerView> healthy = pool_->Healthy();
  metrics_->SetWorkers(pool_->Workers());
  if (healthy.size() < 2 || options_.mode != PlacementMode::kAffinity) return;
  auto free_fraction = [](const WorkerView& w) {
    const auto& l = w.load;
    return l.pages_total_device() > 0 ? double(l.pages_free_device()) / double(l.pages_total_device()) : 1.0;
  };
  // A worker whose load predates the last move off or onto it is left alone
  // this pass: acting on it would move sessions the move already relieved it of
  // (or pile more onto a taker that is fuller than it looks).
  absl::erase_if(rebalance_moved_at_report_, [this](const auto& entry) { return !pool_->Find(entry.first); });
  auto settled = [this](const WorkerView& w) {
    auto it = rebalance_moved_at_report_.find(w.address);
    if (it == rebalance_moved_at_report_.end()) return true;
    if (w.load_reports < it->second + 2) return false;
    rebalance_moved_at_report_.erase(it);
    return true;
  };
  // The taker: the worker with the most free pages, among those that take new
  // sessions (not one that left DNS).
  const WorkerView* cold = nullptr;
  for (const WorkerView& w : healthy) {
    if (!w.departed && settled(w) && (cold == nullptr || free_fraction(w) > free_fraction(*cold))) cold = &w;
  }
  if (cold == nullptr) return;
  if (free_fraction(*cold) < options_.rebalance_high_free) return;
  // The taker's free pages, less those of the sessions moved onto it this pass.
  const int64_t cold_total = cold->load.pages_total_device();
  const int32_t cold_page_tokens = cold->kv_shape.page_tokens();
  int64_t cold_free = cold->load.pages_free_device();
  for (const WorkerView& hot : healthy) {
    if (&hot == cold || free_fraction(hot) >= options_.rebalance_low_free || !settled(hot)) continue;
    // The pass stops once the pages it moved lift the worker to --rebalance_low_free:
    // a session's pages (shared prefix pages may stay, so this is an upper bound)
    // are counted as freed, instead of moving the whole batch on a load report
    // that predates the first move.
    const int64_t total = hot.load.pages_total_device();
    const int32_t page_tokens = hot.kv_shape.page_tokens();  // 0 before the first snapshot
    int64_t free_pages = hot.load.pages_free_device();
    int moved = 0;
    for (const SessionLocation& s : directory_->SessionsOn(hot.address)) {
      if (moved >= options_.rebalance_batch ||
          double(free_pages) >= options_.rebalance_low_free * double(total)) {
        break;
      }
      // Moving bytes beats recomputing only for sessions of some length.
      if (s.tier != v1::TIER_DEVICE || s.tokens < options_.rebalance_min_tokens) continue;
      // A session that would take the taker under the low mark moves the
      // pressure instead of relieving it, and the next pass would move it back
      // (the marks' gap is no hysteresis for a session larger than it).
      const int64_t cold_pages =
          cold_page_tokens > 0 ? (s.tokens + cold_page_tokens - 1) / cold_page_tokens : 0;
      if (double(cold_free - cold_pages) < options_.rebalance_low_free * double(cold_total)) continue;
      auto r = Migrate(s.key(), cold->address, "rebalance");
      if (r.ok()) {
        ++moved;
        cold_free -= cold_pages;
        if (page_tokens > 0) free_pages += (s.tokens + page_tokens - 1) / page_tokens;
        KV_LOG_INFO("rebalance: moved session '{}' ({} tokens) {} -> {}", s.session_id, s.tokens, hot.address,
                    cold->address);
      }
    }
    if (moved > 0) {
      // The counts now: reports that arrive later may still predate the moves.
      for (const WorkerView& w : pool_->Workers()) {
        if (w.address == hot.address || w.address == cold->address) {
          rebalance_moved_at_report_[w.address] = w.load_reports;
        }
      }
    }
  }
}

namespace {

// An admin call: authenticates as admin, then `start(done)` begins the work,
// which answers through `done` (from any thread; none blocks on a worker).
template <typename Resp, typename Start>
grpc::ServerUnaryReactor* AdminCall(RouterService* router, grpc::CallbackServerContext* context,
                                    Resp* response, Start start) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  auto principal = router->auth().Authenticate(*context, /*need_admin=*/true);
  if (!principal.ok()) {
    reactor->Finish(ToGrpcStatus(principal.status()));
    return reactor;
  }
  start([reactor, response](absl::StatusOr<Resp> r) {
    if (r.ok()) *response = std::move(*r);
    reactor->Finish(ToGrpcStatus(r.status()));
  });
  return reactor;
}

}  // namespace

grpc::ServerUnaryReactor* AdminService::ListWorkers(grpc::CallbackServerContext* context,
                                                    const v1::ListWorkersRequest* /*request*/,
                                                    v1::ListWorkersResponse* response) {
  return AdminCall(router_, context, response, [this](RouterService::Done<v1::ListWorkersResponse> done) {
    std::move(done)(router_->ListWorkers());
  });
}

grpc::ServerUnaryReactor* AdminService::MigrateSession(grpc::CallbackServerContext* context,
                                                       const v1::AdminMigrateRequest* request,
                                                       v1::MigrateSessionResponse* response) {
  return AdminCall(
      router_, context, response, [this, request](RouterService::Done<v1::MigrateSessionResponse> done) {
        router_->MigrateByIdAsync(request->session_id(), request->target_worker(), std::move(done));
      });
}

grpc::ServerUnaryReactor* AdminService::DrainWorker(grpc::CallbackServerContext* context,
                                                    const v1::DrainWorkerRequest* request,
                                                    v1::DrainResponse* response) {
  return AdminCall(router_, context, response, [this, request](RouterService::Done<v1::DrainResponse> done) {
    router_->DrainWorkerAsync(request->worker(), request->deadline_ms(), std::move(done));
  });
}

}  // namespace kvcache::router
