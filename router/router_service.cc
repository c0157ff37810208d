#include "router/router_service.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/block_hash.h"
#include "common/input_tokens.h"
#include "common/logging.h"
#include "common/status.h"
#include "common/stream_writer.h"
#include "kvcache/v1/worker.grpc.pb.h"

namespace kvcache::router {
namespace {

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
  return code == grpc::RESOURCE_EXHAUSTED || code == grpc::UNAVAILABLE;
}

}  // namespace

absl::StatusOr<PlacementMode> ParsePlacementMode(const std::string& s) {
  if (s == "affinity") return PlacementMode::kAffinity;
  if (s == "round_robin") return PlacementMode::kRoundRobin;
  if (s == "random") return PlacementMode::kRandom;
  return absl::InvalidArgumentError(
      absl::StrCat("--placement='", s, "': want affinity, round_robin or random"));
}

// One client Generate: places it, proxies the worker's stream, and retries or
// continues elsewhere as the header comment says. Runs on its own thread.
class RouterService::ProxyReactor : public StreamWriter<v1::GenerateResponse> {
 public:
  ProxyReactor(RouterService* router, grpc::CallbackServerContext* context, v1::GenerateRequest request)
      : router_(router), context_(context), request_(std::move(request)), start_(absl::Now()) {}

  void Run() {
    const grpc::Status st = Proxy();
    router_->metrics_->OnRequestDone(CodeName(st));
    Close(st);
  }

 private:
  grpc::Status Proxy() {
    auto principal = router_->auth_->Authenticate(*context_, /*need_admin=*/false);
    if (!principal.ok()) return ToGrpcStatus(principal.status());
    request_.set_tenant(principal->tenant);
    const bool append = request_.mode() == v1::APPEND;
    if (append && request_.session_id().empty()) {
      return grpc::Status(grpc::INVALID_ARGUMENT, "APPEND mode needs a session_id");
    }
    // The router's own tokenisation: for prefix hashes, and to continue a lost
    // stream elsewhere from exactly what the client has.
    auto tokens = TokenizeInput(request_.input(), append, *router_->tokenizer_, router_->chat_template_);
    if (!tokens.ok()) return ToGrpcStatus(tokens.status());

    std::vector<WorkerId> tried;
    grpc::Status last(grpc::UNAVAILABLE, "no healthy worker");
    for (int attempt = 0; attempt < router_->options_.max_attempts; ++attempt) {
      auto placement = router_->Place(request_.session_id(), request_.tenant(), append, *tokens, tried);
      if (!placement.ok()) return tried.empty() ? ToGrpcStatus(placement.status()) : last;
      if (attempt > 0) {
        placement->reason = PlacementReason::kRetry;
        router_->metrics_->OnRetry();
      }
      router_->metrics_->OnDecision(
          router_->options_.mode == PlacementMode::kAffinity
              ? PlacementReasonName(placement->reason)
              : (router_->options_.mode == PlacementMode::kRoundRobin ? "round_robin" : "random"));
      tried.push_back(placement->worker);

      v1::GenerateRequest req = request_;
      if (!emitted_.empty()) {
        // Continue from what the client already received.
        std::vector<int32_t> input = *tokens;
        input.insert(input.end(), emitted_.begin(), emitted_.end());
        req.mutable_input()->mutable_tokens()->mutable_ids()->Assign(input.begin(), input.end());
        req.set_mode(v1::FULL_CONTEXT);
        const int32_t max = request_.sampling().max_tokens();
        if (max > 0)
          req.mutable_sampling()->set_max_tokens(
              std::max<int32_t>(1, max - static_cast<int32_t>(emitted_.size())));
      }
      const size_t before = emitted_.size();
      continued_from_ = before;
      last = Attempt(*placement, req);
      if (last.ok()) return last;
      if (client_gone_.load()) return grpc::Status(grpc::CANCELLED, "client cancelled");
      const bool first_token_sent = !emitted_.empty();
      const bool lost_midstream =
          emitted_.size() > before || (first_token_sent && last.error_code() == grpc::UNAVAILABLE);
      if (last.error_code() == grpc::UNAVAILABLE) router_->pool_->MarkSuspect(placement->worker);
      if (append && (lost_midstream || last.error_code() == grpc::UNAVAILABLE)) {
        return grpc::Status(
            grpc::UNAVAILABLE,
            absl::StrCat("session '", request_.session_id(), "' was lost with worker ", placement->worker,
                         " (", last.error_message(), "); resend the whole conversation with FULL_CONTEXT"));
      }
      if (!Retryable(last.error_code())) return last;
      KV_LOG_WARN("request on worker {} failed ({}); trying another worker", placement->worker,
                  last.error_message());
    }
    return last;
  }

  // One worker call. Streams tokens to the client as they come.
  grpc::Status Attempt(const Placement& placement, const v1::GenerateRequest& req) {
    auto channel = router_->pool_->Channel(placement.worker);
    if (channel == nullptr) return grpc::Status(grpc::UNAVAILABLE, "worker left the pool");
    auto stub = v1::Worker::NewStub(channel);
    grpc::ClientContext ctx;
    ctx.set_deadline(context_->deadline());
    {
      absl::MutexLock lock(&mu_);
      if (client_gone_.load()) return grpc::Status(grpc::CANCELLED, "client cancelled");
      call_ = &ctx;
    }
    auto reader = stub->Generate(&ctx, req);
    v1::GenerateResponse msg;
    while (reader->Read(&msg)) {
      if (msg.has_token()) {
        if (emitted_.empty()) router_->metrics_->OnFirstToken(absl::ToDoubleSeconds(absl::Now() - start_));
        emitted_.push_back(msg.token().id());
        Push(msg);
      } else if (msg.has_final()) {
        auto* f = msg.mutable_final();
        f->set_predicted_cached_tokens(placement.predicted_cached_tokens);
        router_->metrics_->OnCachedTokens(placement.predicted_cached_tokens, f->usage().cached_tokens());
        // Report the client's view: after a continuation elsewhere, the worker's
        // prompt included the tokens the client had already received.
        f->mutable_usage()->set_prompt_tokens(f->usage().prompt_tokens() -
                                              static_cast<int32_t>(continued_from_));
        f->mutable_usage()->set_generated_tokens(static_cast<int32_t>(emitted_.size()));
        f->mutable_usage()->set_total_time_us(absl::ToInt64Microseconds(absl::Now() - start_));
        Push(msg);
      }
    }
    grpc::Status st = reader->Finish();
    absl::MutexLock lock(&mu_);
    call_ = nullptr;
    return st;
  }

  void OnClientGone() override {
    absl::MutexLock lock(&mu_);
    client_gone_ = true;
    if (call_ != nullptr) call_->TryCancel();
  }

  RouterService* const router_;
  grpc::CallbackServerContext* const context_;
  v1::GenerateRequest request_;
  const absl::Time start_;
  std::vector<int32_t> emitted_;  // proxy thread only
  size_t continued_from_ = 0;     // tokens already streamed when the current attempt began
  std::atomic<bool> client_gone_{false};
  absl::Mutex mu_;
  grpc::ClientContext* call_ ABSL_GUARDED_BY(mu_) = nullptr;
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
      metrics_(metrics) {
  if (options_.rebalance_interval > absl::ZeroDuration()) {
    rebalancer_ = std::thread([this] {
      while (!stop_.WaitForNotificationWithTimeout(options_.rebalance_interval)) Rebalance();
    });
  }
  evacuator_ = std::thread([this] {
    while (!stop_.WaitForNotificationWithTimeout(options_.evacuate_interval)) EvacuateDraining();
  });
}

RouterService::~RouterService() { Shutdown(); }

void RouterService::Shutdown() {
  if (!stop_.HasBeenNotified()) stop_.Notify();
  if (rebalancer_.joinable()) rebalancer_.join();
  if (evacuator_.joinable()) evacuator_.join();
  std::vector<std::thread> threads;
  {
    absl::MutexLock lock(&mu_);
    shutting_down_ = true;
    threads.swap(threads_);
  }
  for (auto& t : threads) t.join();
}

void RouterService::RunInBackground(std::function<void()> fn) {
  absl::MutexLock lock(&mu_);
  // Reap finished threads now and then so a long-running router does not grow.
  if (threads_.size() > 256) {
    std::vector<std::thread> done;
    done.swap(threads_);
    for (auto& t : done) t.join();
  }
  threads_.emplace_back(std::move(fn));
}

absl::StatusOr<Placement> RouterService::Place(const std::string& session_id, const std::string& tenant,
                                               bool append, const std::vector<int32_t>& tokens,
                                               const std::vector<WorkerId>& exclude) {
  std::vector<WorkerView> healthy = pool_->Healthy();
  auto excluded = [&exclude](const WorkerId& w) {
    return std::find(exclude.begin(), exclude.end(), w) != exclude.end();
  };
  std::optional<SessionLocation> loc;
  if (!session_id.empty()) {
    loc = append ? directory_->AwaitSession(session_id, options_.session_lookup_wait)
                 : directory_->FindSession(session_id);
    if (loc.has_value() && loc->tenant != tenant && !loc->tenant.empty()) loc.reset();  // not yours
  }
  if (append) {
    if (!loc.has_value()) return absl::NotFoundError(absl::StrCat("session '", session_id, "' not found"));
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
    if (!excluded(w.address)) cands.push_back(std::move(w));
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
  const std::vector<BlockHash> chain = ChainBlockHashes(tokens, page_tokens, cands.front().model_id, tenant);
  const auto matches = directory_->MatchPrefix(chain);
  const auto session_counts = directory_->SessionCounts();
  std::vector<Candidate> candidates;
  for (const WorkerView& w : cands) {
    Candidate c;
    c.worker = w.address;
    c.load = w.load;
    auto m = matches.find(w.address);
    if (m != matches.end()) c.match = m->second;
    if (auto n = session_counts.find(w.address); n != session_counts.end()) c.sessions = n->second;
    candidates.push_back(std::move(c));
  }
  // Ties among equals go by rendezvous of the session id (or the prompt's start).
  const std::string key =
      session_id.empty()
          ? absl::StrJoin(tokens.begin(), tokens.begin() + std::min<size_t>(tokens.size(), 64), ",")
          : session_id;
  const int request_pages = static_cast<int>((tokens.size() + page_tokens - 1) / page_tokens);
  return Choose(options_.placement, key, loc.has_value() ? loc->worker : WorkerId(), page_tokens,
                request_pages, candidates, /*retry=*/false);
}

grpc::ServerWriteReactor<v1::GenerateResponse>* RouterService::Generate(grpc::CallbackServerContext* context,
                                                                        const v1::GenerateRequest* request) {
  auto* reactor = new ProxyReactor(this, context, *request);
  {
    absl::MutexLock lock(&mu_);
    if (shutting_down_) {
      reactor->Close(grpc::Status(grpc::UNAVAILABLE, "router is shutting down"));
      return reactor;
    }
  }
  RunInBackground([reactor] { reactor->Run(); });
  return reactor;
}

// Session calls go to the worker holding the session, on a background thread.
#define KVCACHE_FORWARD_TO_SESSION(METHOD, REQ_TYPE, RESP_TYPE)                                         \
  grpc::ServerUnaryReactor* RouterService::METHOD(grpc::CallbackServerContext* context,                 \
                                                  const REQ_TYPE* request, RESP_TYPE* response) {       \
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();                                      \
    auto principal = auth_->Authenticate(*context, false);                                              \
    if (!principal.ok()) {                                                                              \
      reactor->Finish(ToGrpcStatus(principal.status()));                                                \
      return reactor;                                                                                   \
    }                                                                                                   \
    REQ_TYPE req = *request;                                                                            \
    req.set_tenant(principal->tenant);                                                                  \
    RunInBackground([this, reactor, context, req, response] {                                           \
      auto loc = directory_->AwaitSession(req.session_id(), options_.session_lookup_wait);              \
      auto channel = loc.has_value() ? pool_->Channel(loc->worker) : nullptr;                           \
      if (channel == nullptr) {                                                                         \
        reactor->Finish(                                                                                \
            grpc::Status(grpc::NOT_FOUND, absl::StrCat("session '", req.session_id(), "' not found"))); \
        return;                                                                                         \
      }                                                                                                 \
      grpc::ClientContext ctx;                                                                          \
      ctx.set_deadline(DeadlineFor(context, absl::Seconds(60)));                                        \
      reactor->Finish(v1::Worker::NewStub(channel)->METHOD(&ctx, req, response));                       \
    });                                                                                                 \
    return reactor;                                                                                     \
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
  const std::string tenant = principal->tenant;
  RunInBackground([this, reactor, context, tenant, response] {
    for (const WorkerView& w : pool_->Workers()) {
      if (!w.connected) continue;
      auto channel = pool_->Channel(w.address);
      if (channel == nullptr) continue;
      grpc::ClientContext ctx;
      ctx.set_deadline(DeadlineFor(context, absl::Seconds(10)));
      v1::ListSessionsRequest req;
      req.set_tenant(tenant);
      v1::ListSessionsResponse part;
      if (v1::Worker::NewStub(channel)->ListSessions(&ctx, req, &part).ok()) {
        for (auto& s : *part.mutable_sessions()) *response->add_sessions() = std::move(s);
      }
    }
    reactor->Finish(grpc::Status::OK);
  });
  return reactor;
}

absl::StatusOr<v1::ListWorkersResponse> RouterService::ListWorkers() const {
  v1::ListWorkersResponse out;
  for (const WorkerView& w : pool_->Workers()) {
    v1::WorkerInfo* info = out.add_workers();
    info->set_worker_id(w.worker_id);
    info->set_address(w.address);
    info->set_health(!w.connected ? "DOWN"
                                  : (w.draining ? "DRAINING" : (w.healthy ? "SERVING" : "NOT_SERVING")));
    *info->mutable_load() = w.load;
    info->set_sessions(static_cast<int32_t>(directory_->SessionsOn(w.address).size()));
    info->set_model_id(w.model_id);
  }
  return out;
}

absl::StatusOr<v1::MigrateSessionResponse> RouterService::Migrate(const std::string& session_id,
                                                                  const std::string& target,
                                                                  const char* reason) {
  auto loc = directory_->FindSession(session_id);
  if (!loc.has_value()) return absl::NotFoundError(absl::StrCat("session '", session_id, "' not found"));
  WorkerId dest;
  if (!target.empty()) {
    auto w = pool_->Find(target);
    if (!w.has_value()) return absl::NotFoundError(absl::StrCat("worker '", target, "' not found"));
    if (!w->healthy)
      return absl::FailedPreconditionError(absl::StrCat("worker '", target, "' is not healthy"));
    dest = w->address;
  } else {
    auto p = Place("", loc->tenant, false, {}, {loc->worker});
    if (!p.ok()) return p.status();
    dest = p->worker;
  }
  if (dest == loc->worker) return absl::FailedPreconditionError("the session already lives on that worker");
  auto channel = pool_->Channel(loc->worker);
  if (channel == nullptr) return absl::UnavailableError(absl::StrCat("worker ", loc->worker, " is gone"));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::minutes(5));
  v1::MigrateSessionRequest req;
  req.set_session_id(session_id);
  req.set_target_address(dest);
  req.set_tenant(loc->tenant);
  v1::MigrateSessionResponse resp;
  grpc::Status st = v1::Worker::NewStub(channel)->MigrateSession(&ctx, req, &resp);
  if (!st.ok()) return FromGrpcStatus(st);
  metrics_->OnMigration(reason);
  return resp;
}

absl::StatusOr<v1::DrainResponse> RouterService::DrainWorker(const std::string& worker, int32_t deadline_ms) {
  auto w = pool_->Find(worker);
  if (!w.has_value()) return absl::NotFoundError(absl::StrCat("worker '", worker, "' not found"));
  pool_->SetDraining(w->address);
  v1::DrainRequest req;
  for (const WorkerView& other : pool_->Healthy()) {
    if (other.address != w->address) req.add_targets(other.address);
  }
  req.set_deadline_ms(deadline_ms);
  auto channel = pool_->Channel(w->address);
  if (channel == nullptr) return absl::UnavailableError("worker is gone");
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::minutes(10));
  v1::DrainResponse resp;
  grpc::Status st = v1::Worker::NewStub(channel)->Drain(&ctx, req, &resp);
  if (!st.ok()) return FromGrpcStatus(st);
  for (int i = 0; i < resp.sessions_migrated(); ++i) metrics_->OnMigration("drain");
  return resp;
}

void RouterService::EvacuateDraining() {
  for (const WorkerView& w : pool_->Workers()) {
    // An admin drain moves its own sessions (worker Drain with targets).
    if (!w.connected || !w.draining || w.admin_draining) continue;
    for (const SessionLocation& s : directory_->SessionsOn(w.address)) {
      auto r = Migrate(s.session_id, "", "drain");
      if (r.ok()) {
        KV_LOG_INFO("worker {} is draining: moved session '{}' to {}", w.address, s.session_id,
                    r->session().worker_id());
      } else {
        KV_LOG_WARN("worker {} is draining: could not move session '{}': {}", w.address, s.session_id,
                    r.status().ToString());
      }
    }
  }
}

void RouterService::Rebalance() {
  std::vector<WorkerView> healthy = pool_->Healthy();
  metrics_->SetWorkers(pool_->Workers());
  if (healthy.size() < 2 || options_.mode != PlacementMode::kAffinity) return;
  auto free_fraction = [](const WorkerView& w) {
    const auto& l = w.load;
    return l.pages_total_device() > 0 ? double(l.pages_free_device()) / double(l.pages_total_device()) : 1.0;
  };
  const WorkerView* cold = &healthy.front();
  for (const WorkerView& w : healthy) {
    if (free_fraction(w) > free_fraction(*cold)) cold = &w;
  }
  if (free_fraction(*cold) < options_.rebalance_high_free) return;
  for (const WorkerView& hot : healthy) {
    if (free_fraction(hot) >= options_.rebalance_low_free || &hot == cold) continue;
    int moved = 0;
    for (const SessionLocation& s : directory_->SessionsOn(hot.address)) {
      if (moved >= options_.rebalance_batch) break;
      // Moving bytes beats recomputing only for sessions of some length.
      if (s.tier != v1::TIER_DEVICE || s.tokens < options_.rebalance_min_tokens) continue;
      auto r = Migrate(s.session_id, cold->address, "rebalance");
      if (r.ok()) {
        ++moved;
        KV_LOG_INFO("rebalance: moved session '{}' ({} tokens) {} -> {}", s.session_id, s.tokens, hot.address,
                    cold->address);
      }
    }
  }
}

namespace {

// An admin call: authenticates as admin, then runs `call` (which returns
// StatusOr<Resp>) on a background thread, since it may block on workers.
template <typename Resp, typename Call>
grpc::ServerUnaryReactor* AdminCall(RouterService* router, grpc::CallbackServerContext* context,
                                    Resp* response, Call call) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  auto principal = router->auth().Authenticate(*context, /*need_admin=*/true);
  if (!principal.ok()) {
    reactor->Finish(ToGrpcStatus(principal.status()));
    return reactor;
  }
  router->RunInBackground([reactor, response, call] {
    auto r = call();
    if (r.ok()) *response = *r;
    reactor->Finish(ToGrpcStatus(r.status()));
  });
  return reactor;
}

}  // namespace

grpc::ServerUnaryReactor* AdminService::ListWorkers(grpc::CallbackServerContext* context,
                                                    const v1::ListWorkersRequest* /*request*/,
                                                    v1::ListWorkersResponse* response) {
  return AdminCall(router_, context, response, [this] { return router_->ListWorkers(); });
}

grpc::ServerUnaryReactor* AdminService::MigrateSession(grpc::CallbackServerContext* context,
                                                       const v1::AdminMigrateRequest* request,
                                                       v1::MigrateSessionResponse* response) {
  return AdminCall(router_, context, response, [this, request] {
    return router_->Migrate(request->session_id(), request->target_worker(), "admin");
  });
}

grpc::ServerUnaryReactor* AdminService::DrainWorker(grpc::CallbackServerContext* context,
                                                    const v1::DrainWorkerRequest* request,
                                                    v1::DrainResponse* response) {
  return AdminCall(router_, context, response, [this, request] {
    return router_->DrainWorker(request->worker(), request->deadline_ms());
  });
}

}  // namespace kvcache::router
