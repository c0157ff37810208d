#include "worker/sched/engine.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status.h"

namespace kvcache::sched {

const char* FinishReasonName(FinishReason r) {
  switch (r) {
    case FinishReason::kStop:
      return "stop";
    case FinishReason::kLength:
      return "length";
    case FinishReason::kStopString:
      return "stop_string";
    case FinishReason::kContextFull:
      return "context_full";
  }
  return "unknown";
}

struct Engine::Request {
  Request(uint64_t id, GenerateRequest r, GenerateObserver* obs, const tok::Tokenizer* tokenizer,
          int max_tokens)
      : id(id),
        req(std::move(r)),
        observer(obs),
        sampler(req.sampling),
        stop({tokenizer->eos_id()}, req.stop_token_ids, req.stop, max_tokens, req.ignore_eos),
        detok(tokenizer),
        tokenizer(tokenizer),
        submitted(absl::Now()) {}

  const uint64_t id;
  GenerateRequest req;
  GenerateObserver* const observer;
  model::Sampler sampler;
  model::StopCriteria stop;
  tok::StreamingDetokenizer detok;
  const tok::Tokenizer* tokenizer;
  const absl::Time submitted;

  std::string sid;
  bool ephemeral = false;
  bool prepared = false;
  bool started = false;
  bool done = false;
  bool decoding = false;         // the prompt is in the cache; pending holds the sampled token
  std::vector<int32_t> context;  // every token of the conversation so far
  std::vector<int32_t> pending;  // tokens of `context` without K/V yet, in order
  GenerateResult result;
};

Engine::Engine(EngineOptions options, model::ModelRunner* runner, kv::KvCacheManager* kv,
               const tok::Tokenizer* tokenizer)
    : options_(options),
      runner_(runner),
      kv_(kv),
      tokenizer_(tokenizer),
      page_tokens_(kv->shape().page_tokens) {}

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(EngineOptions options, model::ModelRunner* runner,
                                                       kv::KvCacheManager* kv,
                                                       const tok::Tokenizer* tokenizer) {
  if (runner == nullptr || kv == nullptr || tokenizer == nullptr) {
    return absl::InvalidArgumentError("engine needs a runner, a KV cache and a tokenizer");
  }
  if (options.max_batch_tokens < 1 || options.max_running < 1 || options.max_waiting < 0 ||
      options.default_max_tokens < 1 || options.max_tokens_per_request < 1) {
    return absl::InvalidArgumentError("engine limits must be positive");
  }
  options.max_batch_tokens = std::min(options.max_batch_tokens, runner->max_batch_tokens());
  const int64_t model_ctx = runner->hparams().n_ctx_train;
  if (model_ctx > 0) options.max_context = std::min(options.max_context, model_ctx);
  if (options.max_context < 2) return absl::InvalidArgumentError("max_context must be at least 2");
  std::unique_ptr<Engine> e(new Engine(options, runner, kv, tokenizer));
  e->thread_ = std::thread([raw = e.get()] { raw->Loop(); });
  return e;
}

Engine::~Engine() { Stop(); }

absl::Status Engine::CheckOwner(const std::string& id, const std::string& tenant) const {
  auto it = sessions_.find(id);
  if (it == sessions_.end() || it->second.tenant != tenant) {
    return absl::NotFoundError(absl::StrCat("session '", id, "' not found"));
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> Engine::Submit(GenerateRequest request, GenerateObserver* observer) {
  if (observer == nullptr) return absl::InvalidArgumentError("no observer");
  if (request.input.empty()) return absl::InvalidArgumentError("input is empty (no tokens)");
  for (int32_t id : request.input) {
    if (!tokenizer_->IsValid(id)) {
      return absl::InvalidArgumentError(
          absl::StrCat("token id ", id, " outside the vocabulary [0, ", tokenizer_->n_vocab(), ")"));
    }
  }
  KVCACHE_RETURN_IF_ERROR(model::ValidateSamplingConfig(request.sampling, tokenizer_->n_vocab()));
  if (request.max_tokens < 0 || request.max_tokens > options_.max_tokens_per_request) {
    return absl::InvalidArgumentError(absl::StrCat("max_tokens ", request.max_tokens, " outside [0, ",
                                                   options_.max_tokens_per_request, "]"));
  }
  for (int32_t id : request.stop_token_ids) {
    if (!tokenizer_->IsValid(id)) {
      return absl::InvalidArgumentError(absl::StrCat("stop token id ", id, " outside the vocabulary"));
    }
  }
  if (request.mode == RequestMode::kAppend && request.session_id.empty()) {
    return absl::InvalidArgumentError("APPEND needs a session_id");
  }
  const int max_tokens = request.max_tokens == 0 ? options_.default_max_tokens : request.max_tokens;

  absl::MutexLock lock(&mu_);
  if (stopping_) return absl::UnavailableError("engine is stopping");
  if (static_cast<int>(waiting_.size()) >= options_.max_waiting) {
    return absl::ResourceExhaustedError(absl::StrCat("queue full (", waiting_.size(), " waiting)"));
  }
  int64_t context = static_cast<int64_t>(request.input.size());
  const std::string& sid = request.session_id;
  if (!sid.empty()) {
    if (busy_.contains(sid)) {
      return absl::AbortedError(absl::StrCat("session '", sid, "' is busy with another request"));
    }
    auto it = sessions_.find(sid);
    if (request.mode == RequestMode::kAppend) {
      KVCACHE_RETURN_IF_ERROR(CheckOwner(sid, request.tenant));
      context += static_cast<int64_t>(it->second.context.size());
    } else if (it != sessions_.end() && it->second.tenant != request.tenant) {
      return absl::AlreadyExistsError(absl::StrCat("session id '", sid, "' is in use"));
    }
  }
  if (context >= options_.max_context) {
    return absl::InvalidArgumentError(absl::StrCat(
        "context of ", context, " tokens leaves no room under the ", options_.max_context, "-token limit"));
  }
  // The whole context must fit in tier 0 at once (attention reads it there).
  const int64_t pages = (context + 1 + page_tokens_ - 1) / page_tokens_;
  if (pages > kv_->tier_capacity_pages(0)) {
    return absl::ResourceExhaustedError(absl::StrCat("context of ", context, " tokens needs ", pages,
                                                     " KV pages; tier 0 holds ",
                                                     kv_->tier_capacity_pages(0)));
  }
  const TenantLimits& limits = options_.tenant_limits;
  if (limits.max_requests > 0 && inflight_[request.tenant] >= limits.max_requests) {
    return absl::ResourceExhaustedError(absl::StrCat("tenant '", request.tenant, "' has ",
                                                     limits.max_requests, " requests in flight (its limit)"));
  }
  if (!sid.empty() && !sessions_.contains(sid) && limits.max_sessions > 0) {
    int held = 0;
    for (const auto& [id, state] : sessions_) held += state.tenant == request.tenant;
    for (const auto& r : waiting_) {
      held += r->req.tenant == request.tenant && !r->req.session_id.empty() &&
              !sessions_.contains(r->req.session_id);
    }
    if (held >= limits.max_sessions) {
      return absl::ResourceExhaustedError(absl::StrCat("tenant '", request.tenant, "' holds ", held,
                                                       " sessions (its limit is ", limits.max_sessions, ")"));
    }
  }
  if (request.pin) {
    const int64_t need = (context + max_tokens + page_tokens_ - 1) / page_tokens_;
    KVCACHE_RETURN_IF_ERROR(CheckPinQuota(request.tenant, need));
  }
  const uint64_t id = next_request_id_++;
  if (!sid.empty()) busy_.insert(sid);
  ++inflight_[request.tenant];
  waiting_.push_back(std::make_unique<Request>(id, std::move(request), observer, tokenizer_, max_tokens));
  load_.waiting = static_cast<int>(waiting_.size());
  wake_.Signal();
  return id;
}

void Engine::Cancel(uint64_t request_id) {
  absl::MutexLock lock(&mu_);
  cancelled_.insert(request_id);
  wake_.Signal();
}

bool Engine::Prepare(Request& r) {
  r.prepared = true;
  const GenerateRequest& q = r.req;
  absl::Status st;
  if (q.session_id.empty()) {
    r.ephemeral = true;
    r.sid = absl::StrCat("~ephemeral-", ++ephemeral_counter_);
  } else {
    r.sid = q.session_id;
  }
  std::vector<int32_t> known;  // the context the engine holds for the session
  bool exists = false;
  {
    absl::MutexLock lock(&mu_);
    auto it = sessions_.find(r.sid);
    if (it != sessions_.end()) {
      exists = true;
      known = it->second.context;
    }
  }
  if (q.mode == RequestMode::kAppend) {
    if (!exists) {  // closed between Submit and now
      Finish(r, absl::NotFoundError(absl::StrCat("session '", r.sid, "' not found")), std::nullopt);
      return false;
    }
    r.context = std::move(known);
    r.context.insert(r.context.end(), q.input.begin(), q.input.end());
  } else {
    r.context = q.input;
  }

  int64_t cached = 0;
  if (exists && kv_->GetSession(r.sid).ok()) {
    auto tokens = kv_->GetTokens(r.sid);
    if (!tokens.ok()) {
      Finish(r, tokens.status(), std::nullopt);
      return false;
    }
    // Keep the longest common prefix, but at least one token must be computed to
    // get logits.
    const size_t limit = std::min(tokens->size(), r.context.size() - 1);
    size_t lcp = 0;
    while (lcp < limit && (*tokens)[lcp] == r.context[lcp]) ++lcp;
    cached = static_cast<int64_t>(lcp);
    if (lcp < tokens->size()) {
      st = kv_->Truncate(r.sid, cached);
      if (!st.ok()) {  // a sliding window already released what we need: start over
        (void)kv_->CloseSession(r.sid);
        exists = false;
      }
    }
  } else if (exists) {
    exists = false;  // known to the engine but gone from the cache (imported then lost)
  }
  if (!exists || !kv_->GetSession(r.sid).ok()) {
    st = kv_->CreateSession(r.sid, q.tenant);
    if (!st.ok()) {
      Finish(r, st, std::nullopt);
      return false;
    }
    auto attached = kv_->AttachPrefix(r.sid, absl::MakeConstSpan(r.context.data(), r.context.size() - 1));
    cached = attached.ok() ? *attached : 0;
    absl::MutexLock lock(&mu_);
    sessions_[r.sid] = SessionState{q.tenant, r.context};
  }
  r.pending.assign(r.context.begin() + cached, r.context.end());
  r.result.session_id = r.sid;
  r.result.cached_tokens = cached;
  r.result.prompt_tokens = static_cast<int64_t>(r.context.size());
  return true;
}

void Engine::Finish(Request& r, absl::Status status, std::optional<FinishReason> reason) {
  if (r.done) return;
  r.done = true;
  const absl::Time now = absl::Now();
  r.result.total_time = now - r.submitted;
  if (!r.started) r.result.queue_time = r.result.total_time;
  if (reason.has_value()) r.result.finish = *reason;
  r.result.generated_tokens = static_cast<int64_t>(r.result.output.size());
  if (r.prepared && !r.sid.empty()) {
    if (r.ephemeral) {
      (void)kv_->CloseSession(r.sid);
    } else if (kv_->GetSession(r.sid).ok()) {
      (void)kv_->MarkIdle(r.sid);
      if (r.req.pin && status.ok()) (void)kv_->PinSession(r.sid);
    }
  }
  {
    absl::MutexLock lock(&mu_);
    if (!r.req.session_id.empty()) busy_.erase(r.req.session_id);
    cancelled_.erase(r.id);
    if (--inflight_[r.req.tenant] <= 0) inflight_.erase(r.req.tenant);
    if (r.prepared && r.ephemeral) {
      sessions_.erase(r.sid);
    } else if (r.prepared) {
      auto it = sessions_.find(r.sid);
      if (it != sessions_.end()) it->second.context = r.context;
    }
  }
  r.observer->OnDone(status, r.result);
}

bool Engine::Step() {
  const absl::Time start = absl::Now();
  int budget = options_.max_batch_tokens;
  struct Planned {
    Request* r;
    int n;
    kv::StepReservation res;
  };
  std::vector<Planned> plan;
  // Decode first: one token per request past its prompt; then prefill chunks.
  for (int pass = 0; pass < 2 && budget > 0; ++pass) {
    for (auto& rp : active_) {
      Request& r = *rp;
      if (r.done || !r.prepared || r.decoding != (pass == 0) || r.pending.empty() || budget == 0) continue;
      const int n = std::min<int>(budget, static_cast<int>(r.pending.size()));
      auto res = kv_->BeginStep(r.sid, n);
      if (!res.ok()) {
        if (res.status().code() == absl::StatusCode::kResourceExhausted) continue;  // wait for room
        Finish(r, res.status(), std::nullopt);
        continue;
      }
      if (!r.started) {
        r.started = true;
        r.result.queue_time = absl::Now() - r.submitted;
        r.result.restored_tokens =
            std::min<int64_t>(res->restored_pages * page_tokens_, r.result.cached_tokens);
      }
      budget -= n;
      plan.push_back(Planned{&r, n, std::move(*res)});
    }
  }
  if (plan.empty()) return false;

  std::vector<model::SequenceStep> batch;
  batch.reserve(plan.size());
  int decode_tokens = 0, prefill_tokens = 0;
  for (Planned& p : plan) {
    model::SequenceStep s;
    s.tokens = absl::MakeConstSpan(p.r->pending.data(), p.n);
    s.first_pos = p.res.first_pos;
    s.page_table = p.res.page_table;
    s.want_logits = p.n == static_cast<int>(p.r->pending.size());
    (p.r->decoding ? decode_tokens : prefill_tokens) += p.n;
    batch.push_back(s);
  }
  std::vector<float> logits;
  absl::Status st = runner_->Forward(batch, &logits);
  if (!st.ok()) {
    KV_LOG_ERROR("forward step failed: {}", st.ToString());
    for (Planned& p : plan) {
      (void)kv_->AbortStep(p.r->sid);
      Finish(*p.r, absl::InternalError(absl::StrCat("model step failed: ", st.message())), std::nullopt);
    }
    return true;
  }

  const int64_t vocab = runner_->hparams().n_vocab;
  size_t row = 0;
  for (size_t i = 0; i < plan.size(); ++i) {
    Request& r = *plan[i].r;
    const int n = plan[i].n;
    st = kv_->CommitStep(r.sid, absl::MakeConstSpan(r.pending.data(), n));
    if (!st.ok()) {
      Finish(r, st, std::nullopt);
      if (batch[i].want_logits) ++row;
      continue;
    }
    r.pending.erase(r.pending.begin(), r.pending.begin() + n);
    if (!batch[i].want_logits) continue;
    absl::Span<const float> lg(logits.data() + row * vocab, static_cast<size_t>(vocab));
    ++row;
    const int32_t token = r.sampler.Sample(lg);
    if (r.result.output.empty()) r.result.time_to_first_token = absl::Now() - r.submitted;
    r.result.output.push_back(token);
    r.context.push_back(token);
    std::string text = r.detok.Add(token).value_or("");
    r.observer->OnToken(token, text);
    auto reason = r.stop.Add(token, text);
    using R = model::StopCriteria::Reason;
    if (reason == R::kEos || reason == R::kStopToken) {
      Finish(r, absl::OkStatus(), FinishReason::kStop);
    } else if (reason == R::kStopString) {
      Finish(r, absl::OkStatus(), FinishReason::kStopString);
    } else if (reason == R::kLength) {
      Finish(r, absl::OkStatus(), FinishReason::kLength);
    } else if (static_cast<int64_t>(r.context.size()) >= options_.max_context) {
      Finish(r, absl::OkStatus(), FinishReason::kContextFull);
    } else {
      r.decoding = true;
      r.pending.assign(1, token);
    }
  }

  const absl::Time end = absl::Now();
  recent_decode_.emplace_back(end, decode_tokens);
  while (!recent_decode_.empty() && end - recent_decode_.front().first > absl::Seconds(1)) {
    recent_decode_.pop_front();
  }
  StepStats stats{static_cast<int>(plan.size()), decode_tokens, prefill_tokens, end - start};
  std::function<void(const StepStats&)> cb;
  {
    absl::MutexLock lock(&mu_);
    cb = step_callback_;
  }
  if (cb) cb(stats);
  return true;
}

void Engine::Loop() {
  while (true) {
    std::vector<std::unique_ptr<Request>> admitted;
    absl::flat_hash_set<uint64_t> cancelled;
    bool stopping;
    {
      absl::MutexLock lock(&mu_);
      const bool has_active = !active_.empty();
      auto ready = [this, has_active]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || has_active || !waiting_.empty();
      };
      mu_.Await(absl::Condition(&ready));
      stopping = stopping_;
      while (!waiting_.empty() && static_cast<int>(active_.size() + admitted.size()) < options_.max_running) {
        admitted.push_back(std::move(waiting_.front()));
        waiting_.pop_front();
      }
      if (stopping) {
        while (!waiting_.empty()) {
          admitted.push_back(std::move(waiting_.front()));
          waiting_.pop_front();
        }
      }
      cancelled = cancelled_;
    }
    for (auto& r : admitted) active_.push_back(std::move(r));
    const absl::Time now = absl::Now();
    for (auto& rp : active_) {
      Request& r = *rp;
      if (stopping) {
        Finish(r, absl::UnavailableError("worker is shutting down"), std::nullopt);
      } else if (cancelled.contains(r.id)) {
        Finish(r, absl::CancelledError("request cancelled"), std::nullopt);
      } else if (now > r.req.deadline) {
        Finish(r, absl::DeadlineExceededError("deadline passed before generation ended"), std::nullopt);
      } else if (!r.prepared) {
        Prepare(r);
      }
    }
    if (!stopping) {
      const bool progressed = Step();
      if (!progressed) {
        // Nothing fits: fail the newest request that has not started so that the
        // others (and future requests) can make progress.
        for (auto it = active_.rbegin(); it != active_.rend(); ++it) {
          if (!(*it)->done) {
            Finish(**it, absl::ResourceExhaustedError("no KV cache memory to run the request"), std::nullopt);
            break;
          }
        }
      }
    }
    active_.erase(std::remove_if(active_.begin(), active_.end(), [](const auto& r) { return r->done; }),
                  active_.end());
    {
      absl::MutexLock lock(&mu_);
      load_.running = static_cast<int>(active_.size());
      load_.waiting = static_cast<int>(waiting_.size());
      int64_t queued = 0;
      for (const auto& r : active_) {
        if (!r->decoding) queued += static_cast<int64_t>(r->pending.size());
      }
      for (const auto& r : waiting_) queued += static_cast<int64_t>(r->req.input.size());
      load_.queued_prefill_tokens = queued;
      int decoded = 0;
      for (const auto& [t, n] : recent_decode_) decoded += n;
      load_.decode_tokens_per_second = decoded;
      if (stopping && active_.empty()) return;
    }
  }
}

void Engine::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    wake_.Signal();
  }
  if (thread_.joinable()) thread_.join();
}

bool Engine::WaitIdle(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return load_.running == 0 && waiting_.empty() && busy_.empty();
  };
  return mu_.AwaitWithTimeout(absl::Condition(&idle), timeout);
}

bool Engine::WaitNoSessions(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto none = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return sessions_.empty(); };
  return mu_.AwaitWithTimeout(absl::Condition(&none), timeout);
}

EngineLoad Engine::Load() const {
  absl::MutexLock lock(&mu_);
  return load_;
}

void Engine::SetStepCallback(std::function<void(const StepStats&)> callback) {
  absl::MutexLock lock(&mu_);
  step_callback_ = std::move(callback);
}

absl::Status Engine::Reserve(const std::string& id, const std::string& tenant) {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(id);
  const bool others = it != sessions_.end() && it->second.tenant != tenant;
  // A session whose first request is still queued is busy before it is known.
  if (busy_.contains(id) && !others) {
    return absl::AbortedError(absl::StrCat("session '", id, "' is busy with a request"));
  }
  KVCACHE_RETURN_IF_ERROR(CheckOwner(id, tenant));
  busy_.insert(id);
  return absl::OkStatus();
}

absl::Status Engine::ReserveWait(const std::string& id, const std::string& tenant, absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  KVCACHE_RETURN_IF_ERROR(CheckOwner(id, tenant));
  auto free = [this, &id]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !busy_.contains(id); };
  if (!mu_.AwaitWithTimeout(absl::Condition(&free), timeout)) {
    return absl::AbortedError(
        absl::StrCat("session '", id, "' stayed busy for ", absl::FormatDuration(timeout)));
  }
  KVCACHE_RETURN_IF_ERROR(CheckOwner(id, tenant));  // it may have been closed meanwhile
  busy_.insert(id);
  return absl::OkStatus();
}

void Engine::Release(const std::string& id) {
  absl::MutexLock lock(&mu_);
  busy_.erase(id);
}

absl::Status Engine::CloseSession(const std::string& id, const std::string& tenant) {
  KVCACHE_RETURN_IF_ERROR(Reserve(id, tenant));
  absl::Status st = kv_->CloseSession(id);
  if (st.code() == absl::StatusCode::kNotFound) st = absl::OkStatus();  // cache already lost it
  absl::MutexLock lock(&mu_);
  busy_.erase(id);
  if (st.ok()) sessions_.erase(id);
  return st;
}

absl::Status Engine::ForkSession(const std::string& id, const std::string& new_id,
                                 const std::string& tenant) {
  KVCACHE_RETURN_IF_ERROR(Reserve(id, tenant));
  std::vector<int32_t> context;
  absl::Status st;
  {
    absl::MutexLock lock(&mu_);
    if (sessions_.contains(new_id) || busy_.contains(new_id)) {
      st = absl::AlreadyExistsError(absl::StrCat("session '", new_id, "' already exists"));
    } else {
      context = sessions_[id].context;
    }
  }
  if (st.ok()) st = kv_->Fork(id, new_id);
  absl::MutexLock lock(&mu_);
  busy_.erase(id);
  if (st.ok()) sessions_[new_id] = SessionState{tenant, std::move(context)};
  return st;
}

absl::Status Engine::CheckPinQuota(const std::string& tenant, int64_t extra_pages) const {
  const int64_t limit = options_.tenant_limits.max_pinned_pages;
  if (limit <= 0) return absl::OkStatus();
  int64_t pinned = 0;
  for (const auto& [id, state] : sessions_) {
    if (state.tenant != tenant) continue;
    auto info = kv_->GetSession(id);
    if (info.ok() && info->user_pinned) pinned += info->tier0_pages + info->tier1_pages;
  }
  if (pinned + extra_pages > limit) {
    return absl::ResourceExhaustedError(absl::StrCat("tenant '", tenant, "' would pin ", pinned + extra_pages,
                                                     " pages; its limit is ", limit));
  }
  return absl::OkStatus();
}

absl::Status Engine::SetPinned(const std::string& id, const std::string& tenant, bool pinned) {
  if (pinned) {
    auto info = kv_->GetSession(id);
    absl::MutexLock lock(&mu_);
    KVCACHE_RETURN_IF_ERROR(CheckOwner(id, tenant));
    if (info.ok() && !info->user_pinned) {
      KVCACHE_RETURN_IF_ERROR(CheckPinQuota(tenant, info->tier0_pages + info->tier1_pages));
    }
  }
  KVCACHE_RETURN_IF_ERROR(Reserve(id, tenant));
  absl::Status st = pinned ? kv_->PinSession(id) : kv_->UnpinSession(id);
  Release(id);
  return st;
}

absl::Status Engine::Offload(const std::string& id, const std::string& tenant) {
  KVCACHE_RETURN_IF_ERROR(Reserve(id, tenant));
  absl::Status st = kv_->Offload(id);
  Release(id);
  return st;
}

absl::Status Engine::Restore(const std::string& id, const std::string& tenant) {
  KVCACHE_RETURN_IF_ERROR(Reserve(id, tenant));
  absl::Status st = kv_->Restore(id);
  Release(id);
  return st;
}

absl::StatusOr<std::vector<int32_t>> Engine::Context(const std::string& id) const {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return absl::NotFoundError(absl::StrCat("session '", id, "' not found"));
  return it->second.context;
}

absl::Status Engine::AdoptSession(const std::string& id, const std::string& tenant,
                                  std::vector<int32_t> context) {
  for (int32_t t : context) {
    if (!tokenizer_->IsValid(t)) {
      return absl::InvalidArgumentError(
          absl::StrCat("session '", id, "': context token ", t, " outside the vocabulary"));
    }
  }
  KVCACHE_ASSIGN_OR_RETURN(std::vector<int32_t> cached, kv_->GetTokens(id));
  if (cached.size() > context.size() || !std::equal(cached.begin(), cached.end(), context.begin())) {
    return absl::InvalidArgumentError(
        absl::StrCat("session '", id, "': cached tokens are not a prefix of its context"));
  }
  absl::MutexLock lock(&mu_);
  sessions_[id] = SessionState{tenant, std::move(context)};
  return absl::OkStatus();
}

void Engine::ForgetSession(const std::string& id) {
  absl::MutexLock lock(&mu_);
  sessions_.erase(id);
}

}  // namespace kvcache::sched
