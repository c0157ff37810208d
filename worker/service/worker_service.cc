#include "worker/service/worker_service.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status.h"
#include "common/stream_writer.h"
#include "worker/kv/kv_transfer.h"
#include "worker/service/chunk_convert.h"
#include "worker/service/request_convert.h"

namespace kvcache::service {
namespace {

grpc::ServerUnaryReactor* Answer(grpc::CallbackServerContext* context, const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

std::string CodeName(const absl::Status& st) { return st.ok() ? "OK" : absl::StatusCodeToString(st.code()); }

// A streaming call refused before it starts (an unauthenticated caller).
template <typename Reactor>
class RefusedCall : public Reactor {
 public:
  explicit RefusedCall(const absl::Status& status) { this->Finish(ToGrpcStatus(status)); }
  void OnDone() override { delete this; }
};

// What a Commit chunk carries of a session beyond its pages: the exporter's
// `pinned`, and from `view` the last reply's and request's lengths, the last request's time,
// whether a reply was left open, what a last request that ended before its first token dropped, and
// the last request's id.
void SetCommitState(const absl::StatusOr<sched::SessionView>& view, bool pinned,
                    v1::SessionChunk::Commit* commit) {
  commit->set_pinned(pinned);
  if (!view.ok()) return;
  commit->set_last_reply_tokens(static_cast<int32_t>(view->last_reply_tokens));
  commit->set_last_request_tokens(static_cast<int32_t>(view->last_request_tokens));
  commit->set_last_used_unix_ms(absl::ToUnixMillis(view->last_used));
  commit->set_reply_open(view->reply_open);
  commit->set_reply_open_before(view->reply_open_before);
  commit->set_last_request_id(view->last_request_id);
  if (view->ended_early.has_value()) {
    commit->set_ended_early_unread(static_cast<int32_t>(view->ended_early->unread));
    commit->set_ended_early_reply_open(view->ended_early->reply_open);
  }
}

v1::Usage ToUsage(const sched::GenerateResult& result) {
  v1::Usage u;
  u.set_prompt_tokens(static_cast<int32_t>(result.prompt_tokens));
  u.set_cached_tokens(static_cast<int32_t>(result.cached_tokens));
  u.set_restored_tokens(static_cast<int32_t>(result.restored_tokens));
  u.set_generated_tokens(static_cast<int32_t>(result.generated_tokens));
  u.set_time_to_first_token_us(absl::ToInt64Microseconds(result.time_to_first_token));
  u.set_total_time_us(absl::ToInt64Microseconds(result.total_time));
  u.set_queue_time_us(absl::ToInt64Microseconds(result.queue_time));
  u.set_recomputed_tokens(static_cast<int32_t>(result.recomputed_tokens));
  return u;
}

sched::ImportedState CommitState(const v1::SessionChunk::Commit& commit) {
  sched::ImportedState state;
  state.pinned = commit.pinned();
  state.unpin_over_quota = commit.unpin_over_quota();
  state.last_reply_tokens = commit.last_reply_tokens();
  state.last_request_tokens = commit.last_request_tokens();
  if (commit.last_used_unix_ms() > 0) state.last_used = absl::FromUnixMillis(commit.last_used_unix_ms());
  if (commit.has_reply_open()) state.reply_open = commit.reply_open();
  if (commit.has_reply_open_before()) state.reply_open_before = commit.reply_open_before();
  state.last_request_id = commit.last_request_id();
  if (commit.has_ended_early_unread()) {
    state.ended_early = sched::SessionDrop{commit.ended_early_unread(), commit.ended_early_reply_open()};
  }
  return state;
}

}  // namespace

// One Generate stream: the engine's observer on one side, the gRPC writer on the
// other. Engine callbacks only queue messages; gRPC writes them in order.
class WorkerService::GenerateReactor : public StreamWriter<v1::GenerateResponse>,
                                       public sched::GenerateObserver {
 public:
  // `context` lives until the call has finished (gRPC's rule for callback
  // calls), which a client gone can do before the engine's OnDone: it is
  // touched only through StreamWriter::Close's open-call hook.
  GenerateReactor(WorkerService* service, grpc::CallbackServerContext* context, bool stream_text)
      : service_(service), context_(context), stream_text_(stream_text), started_(absl::Now()) {}

  void Start(absl::StatusOr<sched::GenerateRequest> request, absl::Time deadline) {
    Ref();  // this call's: the engine may finish the request before Submit returns
    Ref();  // the engine's, dropped after its OnDone (below when it never gets the request)
    Submit(std::move(request), deadline);
    Unref();
  }

  // gRPC's OnDone() (the call is over) and the engine's OnDone(status, result)
  // (the request is over) are different events that share a name.
  using StreamWriter<v1::GenerateResponse>::OnDone;

  // GenerateObserver (engine thread).
  void OnToken(int32_t id, absl::string_view text) override {
    const absl::Time now = absl::Now();
    if (last_token_ != absl::InfinitePast()) service_->metrics_->OnInterTokenLatency(now - last_token_);
    last_token_ = now;
    v1::GenerateResponse msg;
    msg.mutable_token()->set_id(id);
    if (stream_text_) msg.mutable_token()->set_text(text.data(), text.size());
    Push(std::move(msg));
  }

  void OnDone(const absl::Status& status, const sched::GenerateResult& result) override {
    // A call whose deadline passed reaches the engine as a cancellation (gRPC
    // ends the call, OnClientGone cancels): count it as the client saw it. The
    // client's deadline timer fires a little before this server's (its
    // deadline is the client's plus the time the call took to arrive), so a
    // cancellation within kDeadlineSlack of the deadline is the deadline.
    constexpr absl::Duration kDeadlineSlack = absl::Milliseconds(100);
    const bool deadline_passed =
        status.code() == absl::StatusCode::kCancelled && absl::Now() >= deadline_ - kDeadlineSlack;
    service_->metrics_->OnRequestDone(deadline_passed ? "DEADLINE_EXCEEDED" : CodeName(status), &result);
    service_->hub_->Flush();  // routers hear of this request's pages before its client does
    if (status.ok()) {
      v1::GenerateResponse msg;
      auto* f = msg.mutable_final();
      f->set_finish_reason(ToProto(result.finish));
      f->set_session_id(result.session_id);
      f->set_worker_id(service_->options_.worker_id);
      f->set_predicted_cached_tokens(-1);
      *f->mutable_usage() = ToUsage(result);
      Push(std::move(msg));
      Close(grpc::Status::OK);
    } else if (result.generated_tokens > 0) {
      // Cut after tokens: a router that goes on the stream elsewhere reports
      // the usage of the part that served the prompt (kUsageTrailer).
      const std::string usage = ToUsage(result).SerializeAsString();
      Close(ToGrpcStatus(status), [&] { context_->AddTrailingMetadata(kUsageTrailer, usage); });
    } else {
      Close(ToGrpcStatus(status));
    }
    Unref();  // the engine's last call
  }

 private:
  void Submit(absl::StatusOr<sched::GenerateRequest> request, absl::Time deadline) {
    deadline_ = deadline;
    if (!request.ok()) return Fail(request.status());
    if (absl::Status st = service_->RefuseWhileDraining(); !st.ok()) return Fail(st);
    request->deadline = deadline;
    auto id = service_->engine_->Submit(std::move(*request), this);
    if (!id.ok()) return Fail(id.status());
    absl::MutexLock lock(&mu_);
    request_id_ = *id;
    if (cancelled_) service_->engine_->Cancel(request_id_);
  }

  // The engine never got the request: no observer call will come.
  void Fail(const absl::Status& status) {
    service_->metrics_->OnRequestDone(CodeName(status), nullptr);
    Close(ToGrpcStatus(status));
    Unref();  // the engine's
  }

  // Client cancelled, its deadline passed, or a write failed: stop generating; the
  // engine frees the pages at the next step and calls OnDone, which closes.
  void OnClientGone() override {
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
    if (request_id_ != 0) service_->engine_->Cancel(request_id_);
  }

  WorkerService* const service_;
  grpc::CallbackServerContext* const context_;
  const bool stream_text_;
  const absl::Time started_;
  absl::Time deadline_ = absl::InfiniteFuture();  // the call's, set before the engine sees the request
  absl::Time last_token_ = absl::InfinitePast();  // engine thread only
  absl::Mutex mu_;
  uint64_t request_id_ ABSL_GUARDED_BY(mu_) = 0;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
};

// ExportSession: pulls the next chunk from the exporter as each write completes,
// so memory stays at one chunk however large the session.
class WorkerService::ExportReactor : public grpc::ServerWriteReactor<v1::SessionChunk> {
 public:
  ExportReactor(WorkerService* service, std::string session_id, std::string tenant)
      : service_(service), session_id_(std::move(session_id)), tenant_(std::move(tenant)) {}

  void Start(int64_t max_chunk_bytes) {
    absl::Status st = service_->engine_->Reserve(session_id_, tenant_);
    if (!st.ok()) return Done(st);
    reserved_ = true;
    auto context = service_->engine_->Context(session_id_, tenant_);
    if (!context.ok()) return Done(context.status());
    context_ = std::move(*context);
    view_ = service_->engine_->View(session_id_, tenant_);
    kv::ExportOptions eo;
    eo.max_chunk_bytes = max_chunk_bytes;
    auto exporter = service_->engine_->BeginExport(session_id_, tenant_, eo);
    if (!exporter.ok()) return Done(exporter.status());
    exporter_ = std::move(*exporter);
    Next();
  }

  void OnWriteDone(bool ok) override {
    if (!ok) return Done(absl::CancelledError("export stream broken"));
    Next();
  }
  void OnDone() override { delete this; }

 private:
  void Next() {
    kv::KvChunk chunk;
    absl::StatusOr<bool> more = bulk_ ? exporter_->NextBulk(&chunk) : exporter_->NextFinal(&chunk);
    if (!more.ok()) return Done(more.status());
    if (!*more && bulk_) {
      bulk_ = false;
      return Next();
    }
    if (!*more) return Done(absl::OkStatus());
    msg_ = ToWire(chunk, index_++, context_);
    if (msg_.has_commit()) SetCommitState(view_, /*pinned=*/false, msg_.mutable_commit());
    StartWrite(&msg_);
  }

  void Done(const absl::Status& st) {
    if (exporter_ != nullptr) service_->engine_->EndExport(session_id_, tenant_, /*handed_to=*/"");
    exporter_.reset();
    if (reserved_) service_->engine_->Release(session_id_, tenant_);
    reserved_ = false;
    Finish(ToGrpcStatus(st));
  }

  WorkerService* const service_;
  const std::string session_id_;
  const std::string tenant_;
  bool reserved_ = false;
  bool bulk_ = true;
  int32_t index_ = 0;
  std::vector<int32_t> context_;
  absl::StatusOr<sched::SessionView> view_;  // read before the export starts
  std::unique_ptr<kv::SessionExporter> exporter_;
  v1::SessionChunk msg_;
};

// ImportSession: feeds chunks to a staging importer; commits whole or not at all.
class WorkerService::ImportReactor : public grpc::ServerReadReactor<v1::SessionChunk> {
 public:
  ImportReactor(WorkerService* service, v1::SessionInfo* response) : service_(service), response_(response) {}

  void Start() {
    {
      // Counted before the drain check, so that a drain that begins after the
      // check waits for this import (WaitNoImports).
      absl::MutexLock lock(&service_->mu_);
      ++service_->imports_in_flight_;
      counted_ = true;
    }
    if (absl::Status st = service_->RefuseWhileDraining(); !st.ok()) return Done(st);
    auto importer = service_->engine_->BeginImport();
    if (!importer.ok()) return Done(importer.status());
    importer_ = std::move(*importer);
    started_ = absl::Now();
    StartRead(&chunk_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      if (importer_ != nullptr && importer_->committed()) return Done(absl::OkStatus());
      return Done(absl::InvalidArgumentError("import stream ended before its commit chunk"));
    }
    if (importer_->committed()) return Done(absl::InvalidArgumentError("chunks after the commit chunk"));
    // Chunks are numbered from 0 in stream order; a Begin names a valid session.
    if (chunk_.index() != next_index_) {
      return Done(absl::InvalidArgumentError(
          absl::StrCat("import chunk ", next_index_, " carries index ", chunk_.index())));
    }
    ++next_index_;
    if (chunk_.has_begin()) {
      if (absl::Status st = ValidateSessionId(chunk_.begin().session_id()); !st.ok()) return Done(st);
    }
    // A worker that began draining takes no session in: the exporter keeps it
    // and tries elsewhere (a drain its next target, a router another worker).
    if (chunk_.has_commit()) {
      if (absl::Status st = service_->RefuseWhileDraining(); !st.ok()) return Done(st);
    }
    const sched::ImportedState state =
        chunk_.has_commit() ? CommitState(chunk_.commit()) : sched::ImportedState{};
    bytes_ += chunk_.ByteSizeLong();
    std::vector<int32_t> context;
    auto c = FromWire(chunk_, &context);
    if (!c.ok()) return Done(c.status());
    // A pin this worker cannot take (its quota, or a tier 0 that cannot hold the
    // session now) is refused before the commit, which would announce the
    // session placed, then dropped.
    if (chunk_.has_commit()) {
      if (absl::Status st = service_->engine_->CheckImportPin(*importer_, state); !st.ok()) return Done(st);
    }
    absl::Status st = importer_->Add(*c);
    if (!st.ok()) return Done(st);
    if (importer_->committed()) {
      auto name = service_->engine_->FinishImport(*importer_, std::move(context), state);
      if (!name.ok()) return Done(name.status());
      service_->metrics_->OnMigration(/*outgoing=*/false, static_cast<int64_t>(bytes_),
                                      absl::Now() - started_);
      auto info = service_->Describe(name->id, name->tenant);
      if (info.ok()) *response_ = *info;
      service_->hub_->Flush();
    }
    StartRead(&chunk_);
  }

  void OnDone() override { delete this; }

 private:
  void Done(const absl::Status& st) {
    importer_.reset();  // frees staging pages unless committed
    if (counted_) {
      absl::MutexLock lock(&service_->mu_);
      --service_->imports_in_flight_;
      counted_ = false;
    }
    Finish(ToGrpcStatus(st));
  }

  WorkerService* const service_;
  bool counted_ = false;  // in imports_in_flight_
  v1::SessionInfo* const response_;
  std::unique_ptr<kv::SessionImporter> importer_;
  v1::SessionChunk chunk_;
  int32_t next_index_ = 0;  // index the next chunk must carry
  size_t bytes_ = 0;
  absl::Time started_;
};

WorkerService::WorkerService(WorkerServiceOptions options, sched::Engine* engine, kv::KvCacheManager* kv,
                             const tok::Tokenizer* tokenizer, const tok::ChatTemplate* chat_template,
                             WatchHub* hub, WorkerMetrics* metrics, std::function<void(bool)> set_ready,
                             std::function<void()> request_exit)
    : options_(std::move(options)),
      engine_(engine),
      kv_(kv),
      tokenizer_(tokenizer),
      chat_template_(chat_template),
      hub_(hub),
      metrics_(metrics),
      set_ready_(std::move(set_ready)),
      request_exit_(std::move(request_exit)) {}

WorkerService::~WorkerService() {
  std::vector<Background> threads;
  {
    absl::MutexLock lock(&mu_);
    threads.swap(background_);
  }
  for (auto& b : threads) b.thread.join();
}

absl::Status WorkerService::Authorize(const grpc::CallbackServerContext& context) const {
  absl::Status st = options_.cluster_token.Verify(context);
  if (!st.ok()) metrics_->OnUnauthenticated();
  return st;
}

absl::Status WorkerService::CheckTarget(v1::Worker::Stub* stub, const std::string& target) const {
  // With TLS the channel verified the target's certificate; with neither TLS nor
  // a token this worker runs --allow_unauthenticated and checks nobody.
  if (options_.cluster_token.empty()) return absl::OkStatus();
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  v1::PeerHandshakeRequest req;
  req.set_nonce(RandomBytes(32));
  v1::PeerHandshakeResponse resp;
  grpc::Status st = stub->PeerHandshake(&ctx, req, &resp);
  if (st.error_code() == grpc::StatusCode::UNAVAILABLE ||
      st.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
    return absl::UnavailableError(absl::StrCat("target unreachable: ", st.error_message()));
  }
  if (!st.ok() || !options_.cluster_token.CheckProof(req.nonce(), resp.proof())) {
    KV_LOG_WARN("migration target {} did not prove it holds the cluster token ({})", target,
                st.ok() ? "wrong proof" : st.error_message());
    return absl::FailedPreconditionError(
        absl::StrCat("target did not prove it holds this fleet's cluster token (",
                     st.ok() ? "wrong proof" : st.error_message(), ")"));
  }
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* WorkerService::PeerHandshake(grpc::CallbackServerContext* context,
                                                       const v1::PeerHandshakeRequest* request,
                                                       v1::PeerHandshakeResponse* response) {
  if (absl::Status auth = Authorize(*context); !auth.ok()) return Answer(context, auth);
  if (options_.cluster_token.empty()) {
    return Answer(context, absl::FailedPreconditionError("this worker has no cluster token"));
  }
  if (request->nonce().size() < 16 || request->nonce().size() > 64) {
    return Answer(context, absl::InvalidArgumentError("nonce must have 16 to 64 bytes"));
  }
  response->set_proof(options_.cluster_token.Proof(request->nonce()));
  response->set_worker_id(options_.worker_id);
  return Answer(context, absl::OkStatus());
}

void WorkerService::RunInBackground(std::function<void()> fn) {
  std::vector<Background> finished;
  {
    absl::MutexLock lock(&mu_);
    // Join the ones that are done, so that months of migrations keep no threads.
    for (auto it = background_.begin(); it != background_.end();) {
      if (it->done->load()) {
        finished.push_back(std::move(*it));
        it = background_.erase(it);
      } else {
        ++it;
      }
    }
    auto done = std::make_shared<std::atomic<bool>>(false);
    background_.push_back(Background{std::thread([fn = std::move(fn), done] {
                                       fn();
                                       done->store(true);
                                     }),
                                     done});
  }
  for (auto& b : finished) b.thread.join();
}

size_t WorkerService::background_threads() const {
  absl::MutexLock lock(&mu_);
  return background_.size();
}

absl::StatusOr<v1::SessionInfo> WorkerService::Describe(const std::string& id,
                                                        const std::string& tenant) const {
  auto view = engine_->View(id, tenant);
  auto info = kv_->GetSession(kv::SessionKey(tenant, id));
  if (!view.ok() || !info.ok()) return absl::NotFoundError(absl::StrCat("session '", id, "' not found"));
  v1::SessionInfo out;
  out.set_session_id(id);
  out.set_tenant(info->tenant);
  out.set_worker_id(options_.worker_id);
  out.set_tokens_cached(static_cast<int32_t>(info->num_tokens));
  out.set_pages_device(static_cast<int32_t>(info->tier0_pages));
  out.set_pages_host(static_cast<int32_t>(info->tier1_pages));
  out.set_pages_shared(static_cast<int32_t>(info->shared_pages));
  out.set_pinned(info->user_pinned);
  // A request running on it comes first: a drain copies a running session's
  // pages while the request goes on, and it is busy all the same.
  out.set_state(info->running           ? v1::SESSION_RUNNING
                : view->exporting       ? v1::SESSION_MIGRATING
                : info->tier1_pages > 0 ? v1::SESSION_OFFLOADED
                                        : v1::SESSION_IDLE);
  out.set_last_used_unix_ms(absl::ToUnixMillis(view->last_used));
  out.set_context_tokens(static_cast<int32_t>(view->context_tokens));
  return out;
}

grpc::ServerWriteReactor<v1::GenerateResponse>* WorkerService::Generate(grpc::CallbackServerContext* context,
                                                                        const v1::GenerateRequest* request) {
  auto* reactor = new GenerateReactor(this, context, !request->has_stream_text() || request->stream_text());
  absl::Status auth = Authorize(*context);
  reactor->Start(auth.ok() ? ToEngineRequest(*request, *tokenizer_, chat_template_)
                           : absl::StatusOr<sched::GenerateRequest>(auth),
                 absl::FromChrono(context->deadline()));
  return reactor;
}

grpc::ServerUnaryReactor* WorkerService::GetSession(grpc::CallbackServerContext* context,
                                                    const v1::SessionRequest* request,
                                                    v1::SessionInfo* response) {
  if (absl::Status auth = Authorize(*context); !auth.ok()) return Answer(context, auth);
  if (absl::Status st = ValidateSessionId(request->session_id()); !st.ok()) return Answer(context, st);
  auto info = Describe(request->session_id(), TenantOf(request->tenant()));
  if (info.ok()) *response = *info;
  return Answer(context, info.status());
}

grpc::ServerUnaryReactor* WorkerService::ListSessions(grpc::CallbackServerContext* context,
                                                      const v1::ListSessionsRequest* request,
                                                      v1::ListSessionsResponse* response) {
  if (absl::Status auth = Authorize(*context); !auth.ok()) return Answer(context, auth);
  for (const kv::SessionName& s : engine_->Sessions()) {
    if (!request->tenant().empty() && s.tenant != request->tenant()) continue;
    auto info = Describe(s.id, s.tenant);
    if (info.ok()) *response->add_sessions() = *info;
  }
  return Answer(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* WorkerService::CloseSession(grpc::CallbackServerContext* context,
                                                      const v1::SessionRequest* request,
                                                      v1::CloseSessionResponse* response) {
  if (absl::Status auth = Authorize(*context); !auth.ok()) return Answer(context, auth);
  if (absl::Status st = ValidateSessionId(request->session_id()); !st.ok()) return Answer(context, st);
  const std::string tenant = TenantOf(request->tenant());
  int64_t freed = 0;
  absl::Status st = engine_->CloseSession(request->session_id(), tenant, &freed);
  if (st.ok()) {
    response->set_pages_freed(static_cast<int32_t>(freed));
    hub_->Flush();  // routers hear of the close before its caller does
  }
  return Answer(context, st);
}

grpc::ServerUnaryReactor* WorkerService::ForkSession(grpc::CallbackServerContext* context,
                                                     const v1::ForkSessionRequest* request,
                                                     v1::SessionInfo* response) {
  if (absl::Status auth = Authorize(*context); !auth.ok()) return Answer(context, auth);
  if (absl::Status st = RefuseWhileDraining(); !st.ok()) return Answer(context, st);
  if (absl::Status st = ValidateSessionId(request->session_id()); !st.ok()) return Answer(context, st);
  const std::string tenant = TenantOf(request->tenant());
  absl::Status st = ValidateSessionId(request->new_session_id());
  if (st.ok()) st = engine_->ForkSession(request->session_id(), request->new_session_id(), tenant);
  if (st.ok()) {
    hub_->Flush();  // routers hear of the fork before its caller does
    auto info = Describe(request->new_session_id(), tenant);
    if (info.ok()) *response = *info;
    st = info.status();
  }
  return Answer(context, st);
}

grpc::ServerUnaryReactor* WorkerService::PinSession(grpc::CallbackServerContext* context,
                                                    const v1::PinSessionRequest* request,
                                                    v1::SessionInfo* response) {
  if (absl::Status auth = Authorize(*context); !auth.ok()) return Answer(context, auth);
  if (absl::Status st = RefuseWhileDraining(); !st.ok()) return Answer(context, st);
  if (absl::Status st = ValidateSessionId(request->session_id()); !st.ok()) return Answer(context, st);
  const std::string tenant = TenantOf(request->tenant());
  absl::Status st = engine_->SetPinned(request->session_id(), tenant, request->pinned());
  if (st.ok()) {
    auto info = Describe(request->session_id(), tenant);
    if (info.ok()) *response = *info;
    st = info.status();
  }
  return Answer(context, st);
}

grpc::ServerUnaryReactor* WorkerService::OffloadSession(grpc::CallbackServerContext* context,
                                                        const v1::SessionRequest* request,
                                                        v1::SessionInfo* response) {
  if (absl::Status auth = Authorize(*context); !auth.ok()) return Answer(context, auth);
  if (absl::Status st = RefuseWhileDraining(); !st.ok()) return Answer(context, st);
  if (absl::Status st = ValidateSessionId(request->session_id()); !st.ok()) return Answer(context, st);
  const std::string tenant = TenantOf(request->tenant());
  const absl::Time start = absl::Now();
  absl::Status st = engine_->Offload(request->session_id(), tenant);
  if (st.ok()) {
    metrics_->OnOffload(absl::Now() - start);
    auto info = Describe(request->session_id(), tenant);
    if (info.ok()) *response = *info;
    st = info.status();
  }
  return Answer(context, st);
}

grpc::ServerUnaryReactor* WorkerService::RestoreSession(grpc::CallbackServerContext* context,
                                                        const v1::SessionRequest* request,
                                                        v1::SessionInfo* response) {
  if (absl::Status auth = Authorize(*context); !auth.ok()) return Answer(context, auth);
  if (absl::Status st = RefuseWhileDraining(); !st.ok()) return Answer(context, st);
  if (absl::Status st = ValidateSessionId(request->session_id()); !st.ok()) return Answer(context, st);
  const std::string tenant = TenantOf(request->tenant());
  const absl::Time start = absl::Now();
  absl::Status st = engine_->Restore(request->session_id(), tenant);
  if (st.ok()) {
    metrics_->OnRestore(absl::Now() - start);
    auto info = Describe(request->session_id(), tenant);
    if (info.ok()) *response = *info;
    st = info.status();
  }
  return Answer(context, st);
}

grpc::ServerWriteReactor<v1::WatchEvent>* WorkerService::Watch(grpc::CallbackServerContext* context,
                                                               const v1::WatchRequest* /*request*/) {
  if (absl::Status auth = Authorize(*context); !auth.ok()) {
    return new RefusedCall<grpc::ServerWriteReactor<v1::WatchEvent>>(auth);
  }
  return hub_->Subscribe(context);
}

grpc::ServerWriteReactor<v1::SessionChunk>* WorkerService::ExportSession(
    grpc::CallbackServerContext* context, const v1::ExportSessionRequest* request) {
  if (absl::Status auth = Authorize(*context); !auth.ok()) {
    return new RefusedCall<grpc::ServerWriteReactor<v1::SessionChunk>>(auth);
  }
  if (absl::Status st = ValidateSessionId(request->session_id()); !st.ok()) {
    return new RefusedCall<grpc::ServerWriteReactor<v1::SessionChunk>>(st);
  }
  if (request->max_chunk_bytes() < 0) {
    return new RefusedCall<grpc::ServerWriteReactor<v1::SessionChunk>>(absl::InvalidArgumentError(
        absl::StrCat("max_chunk_bytes ", request->max_chunk_bytes(), " is negative (0: the default)")));
  }
  auto* reactor = new ExportReactor(this, request->session_id(), TenantOf(request->tenant()));
  int64_t max_chunk = request->max_chunk_bytes() == 0 ? options_.max_chunk_bytes : request->max_chunk_bytes();
  max_chunk = std::clamp<int64_t>(max_chunk, 1 << 10, 3 << 20);
  reactor->Start(max_chunk);
  return reactor;
}

grpc::ServerReadReactor<v1::SessionChunk>* WorkerService::ImportSession(grpc::CallbackServerContext* context,
                                                                        v1::SessionInfo* response) {
  if (absl::Status auth = Authorize(*context); !auth.ok()) {
    return new RefusedCall<grpc::ServerReadReactor<v1::SessionChunk>>(auth);
  }
  auto* reactor = new ImportReactor(this, response);
  reactor->Start();
  return reactor;
}

absl::StatusOr<v1::MigrateSessionResponse> WorkerService::Migrate(const std::string& session_id,
                                                                  const std::string& tenant,
                                                                  const std::string& target) {
  const absl::Time start = absl::Now();
  KVCACHE_RETURN_IF_ERROR(engine_->Context(session_id, tenant).status());
  auto channel = options_.cluster_token.NewChannel(
      target, options_.peer_credentials ? options_.peer_credentials : grpc::InsecureChannelCredentials(),
      options_.peer_channel_args);
  auto stub = v1::Worker::NewStub(channel);
  if (absl::Status st = CheckTarget(stub.get(), target); !st.ok()) {
    return absl::Status(st.code(), absl::StrCat("migration of '", session_id, "' to ", target,
                                                " refused: ", st.message(), "; the session stays here"));
  }
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::minutes(5));
  v1::SessionInfo imported;
  auto writer = stub->ImportSession(&ctx, &imported);
  int32_t index = 0;
  int64_t bytes = 0;
  kv::ExportOptions eo;
  eo.max_chunk_bytes = options_.max_chunk_bytes;
  KVCACHE_ASSIGN_OR_RETURN(std::unique_ptr<kv::SessionExporter> exporter,
                           engine_->BeginExport(session_id, tenant, eo));
  bool write_failed = false;  // the target ended the import stream
  bool pinned = false;
  absl::StatusOr<sched::SessionView> view = absl::UnknownError("read at the pause");
  auto send = [&](const kv::KvChunk& chunk, const std::vector<int32_t>& context) {
    v1::SessionChunk msg = ToWire(chunk, index++, context);
    if (msg.has_commit()) {
      SetCommitState(view, pinned, msg.mutable_commit());
      msg.mutable_commit()->set_unpin_over_quota(draining());  // this worker is about to exit
    }
    bytes += static_cast<int64_t>(msg.ByteSizeLong());
    write_failed = !writer->Write(msg);
    return !write_failed;
  };
  auto fail = [&](absl::Status why) -> absl::Status {
    exporter.reset();
    engine_->EndExport(session_id, tenant, /*handed_to=*/"");
    // After a failed write the target has ended the import: its status says
    // why (ALREADY_EXISTS, RESOURCE_EXHAUSTED, ...), and cancelling first would
    // replace that with our own CANCELLED.
    if (!write_failed) ctx.TryCancel();
    grpc::Status remote = writer->Finish();
    if (!remote.ok() && write_failed) why = FromGrpcStatus(remote);
    // A client may close the session while it moves (the export then fails).
    const bool still_here = engine_->View(session_id, tenant).ok();
    return absl::Status(
        why.code(), absl::StrCat("migration of '", session_id, "' to ", target, " failed: ", why.message(),
                                 still_here ? "; the session stays here" : "; the session is gone"));
  };
  // Pre-copy: the session keeps serving while its full pages move.
  kv::KvChunk chunk;
  while (true) {
    auto more = exporter->NextBulk(&chunk);
    if (!more.ok()) return fail(more.status());
    if (!*more) break;
    if (!send(chunk, {})) return fail(absl::UnavailableError("target closed the import stream"));
  }
  // Pause: no request may run while the tail and the commit go out.
  absl::Status st = engine_->ReserveWait(session_id, tenant, options_.drain_deadline);
  if (!st.ok()) return fail(st);
  const absl::Time pause_start = absl::Now();
  auto context = engine_->Context(session_id, tenant);
  if (!context.ok()) {
    engine_->Release(session_id, tenant);
    return fail(context.status());
  }
  // The client's pin moves with the session (read while no call can change it).
  auto held = kv_->GetSession(kv::SessionKey(tenant, session_id));
  pinned = held.ok() && held->user_pinned;
  view = engine_->View(session_id, tenant);
  while (true) {
    auto more = exporter->NextFinal(&chunk);
    if (!more.ok()) {
      engine_->Release(session_id, tenant);
      return fail(more.status());
    }
    if (!*more) break;
    if (!send(chunk, chunk.kind == kv::KvChunk::Kind::kCommit ? *context : std::vector<int32_t>{})) {
      engine_->Release(session_id, tenant);
      return fail(absl::UnavailableError("target closed the import stream"));
    }
  }
  writer->WritesDone();
  grpc::Status remote = writer->Finish();
  exporter.reset();
  if (!remote.ok()) {
    engine_->EndExport(session_id, tenant, /*handed_to=*/"");
    engine_->Release(session_id, tenant);
    return absl::Status(static_cast<absl::StatusCode>(remote.error_code()),
                        absl::StrCat("target ", target, " refused session '", session_id,
                                     "': ", remote.error_message(), "; the session stays here"));
  }
  // The target holds it now: drop our copy, announcing where it went (its worker
  // id, as the router's directory names workers; the address if it sent none).
  engine_->EndExport(session_id, tenant, imported.worker_id().empty() ? target : imported.worker_id());
  engine_->Release(session_id, tenant);
  const absl::Time end = absl::Now();
  hub_->Flush();
  metrics_->OnMigration(/*outgoing=*/true, bytes, end - start);
  v1::MigrateSessionResponse resp;
  *resp.mutable_session() = imported;
  resp.set_bytes_moved(bytes);
  resp.set_total_us(absl::ToInt64Microseconds(end - start));
  resp.set_pause_us(absl::ToInt64Microseconds(end - pause_start));
  KV_LOG_INFO("migrated session '{}' to {}: {} bytes in {} ms (pause {} ms)", session_id, target, bytes,
              absl::ToInt64Milliseconds(end - start), absl::ToInt64Milliseconds(end - pause_start));
  return resp;
}

grpc::ServerUnaryReactor* WorkerService::MigrateSession(grpc::CallbackServerContext* context,
                                                        const v1::MigrateSessionRequest* request,
                                                        v1::MigrateSessionResponse* response) {
  if (absl::Status auth = Authorize(*context); !auth.ok()) return Answer(context, auth);
  if (absl::Status st = ValidateSessionId(request->session_id()); !st.ok()) return Answer(context, st);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (request->target_address().empty()) {
    reactor->Finish(ToGrpcStatus(absl::InvalidArgumentError("target_address is empty")));
    return reactor;
  }
  // Migration blocks on another worker: run it off the gRPC thread.
  RunInBackground([this, reactor, request, response] {
    auto resp = Migrate(request->session_id(), TenantOf(request->tenant()), request->target_address());
    if (resp.ok()) *response = *resp;
    reactor->Finish(ToGrpcStatus(resp.status()));
  });
  return reactor;
}

absl::Status WorkerService::RefuseWhileDraining() const {
  return draining() ? absl::UnavailableError(kWorkerDrainingMessage) : absl::OkStatus();
}

void WorkerService::BeginDrain() {
  if (draining_.exchange(true)) return;
  set_ready_(false);
  hub_->Nudge();
  KV_LOG_INFO("draining: readiness NOT_SERVING, new requests refused");
}

bool WorkerService::WaitNoImports(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  return mu_.AwaitWithTimeout(absl::Condition(
                                  +[](int* n) { return *n == 0; }, &imports_in_flight_),
                              timeout);
}

void WorkerService::FinishOrCutStreams(absl::Duration streams_for, absl::Duration cut_wait) {
  if (engine_->WaitIdle(streams_for)) return;
  const int cut = engine_->CutRequests(absl::UnavailableError(kStreamCutByDrainMessage));
  KV_LOG_WARN("drain: cut {} requests still running after {}; their sessions move with the rest", cut,
              absl::FormatDuration(streams_for));
  engine_->WaitIdle(cut_wait);
}

v1::DrainResponse WorkerService::DrainAndMigrate(const std::vector<std::string>& targets,
                                                 absl::Duration deadline) {
  BeginDrain();
  constexpr absl::Duration kCutWait = absl::Seconds(10);  // the next step boundary
  FinishOrCutStreams(deadline, kCutWait);
  WaitNoImports(kCutWait);
  v1::DrainResponse out;
  size_t next = 0;
  for (const kv::SessionName& s : engine_->Sessions()) {
    bool moved = false;
    for (size_t tries = 0; tries < targets.size() && !moved; ++tries) {
      const std::string& target = targets[next++ % targets.size()];
      auto r = Migrate(s.id, s.tenant, target);
      if (r.ok()) {
        moved = true;
      } else {
        KV_LOG_WARN("drain: {}", r.status().ToString());
      }
    }
    if (moved) {
      out.set_sessions_migrated(out.sessions_migrated() + 1);
      continue;
    }
    const absl::Status offloaded = engine_->Offload(s.id, s.tenant);
    if (offloaded.ok()) {
      out.set_sessions_offloaded(out.sessions_offloaded() + 1);
    } else if (!absl::IsNotFound(offloaded)) {  // gone meanwhile: a router moved it, or its client closed it
      out.set_sessions_dropped(out.sessions_dropped() + 1);
    }
  }
  return out;
}

grpc::ServerUnaryReactor* WorkerService::Drain(grpc::CallbackServerContext* context,
                                               const v1::DrainRequest* request, v1::DrainResponse* response) {
  if (absl::Status auth = Authorize(*context); !auth.ok()) return Answer(context, auth);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  std::vector<std::string> targets(request->targets().begin(), request->targets().end());
  const absl::Duration deadline =
      request->deadline_ms() > 0 ? absl::Milliseconds(request->deadline_ms()) : options_.drain_deadline;
  BeginDrain();
  RunInBackground([this, reactor, response, targets, deadline] {
    *response = DrainAndMigrate(targets, deadline);
    reactor->Finish(grpc::Status::OK);
    request_exit_();
  });
  return reactor;
}

}  // namespace kvcache::service
