#include "worker/sched/engine.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status.h"
#include "worker/kv/session_key.h"

namespace kvcache::sched {
namespace {

// The automatic step-time target: a step with prefill may take this many times as
// long as its decodes alone (EngineOptions::max_step_time). Chosen by the
// multi-round QA benchmark's shape a on 2 cores: 2.0 gave ITL p99 3.2x p50,
// 1.5 gave 2.4x at the same output tokens/s.
constexpr double kAutoStepTimeFactor = 1.5;

}  // namespace

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
  // `carried`: the request's own output streamed before it (GenerateRequest::continued).
  Request(uint64_t id, GenerateRequest r, GenerateObserver* obs, const tok::Tokenizer* tokenizer,
          int max_tokens, absl::Span<const int32_t> carried)
      : id(id),
        req(std::move(r)),
        observer(obs),
        sampler(req.sampling),
        stop(tokenizer->eog_ids(), req.stop_token_ids, req.stop, max_tokens, req.ignore_eos),
        detok(tokenizer),
        tokenizer(tokenizer),
        submitted(absl::Now()) {
    // A continued stream's tokens so far, as if this request had generated them.
    using R = model::StopCriteria::Reason;
    for (int32_t token : carried) {
      sampler.Skip(1);
      const R reason = stop.Add(token, detok.Add(token).value_or(""));
      if (reason == R::kNone) continue;
      ended = reason == R::kStopString ? FinishReason::kStopString
              : reason == R::kLength   ? FinishReason::kLength
                                       : FinishReason::kStop;
      break;
    }
  }

  const uint64_t id;
  GenerateRequest req;
  GenerateObserver* const observer;
  model::Sampler sampler;
  model::StopCriteria stop;
  tok::StreamingDetokenizer detok;
  const tok::Tokenizer* tokenizer;
  const absl::Time submitted;
  // Set when a continued stream had ended already (its worker was lost between
  // its last token and the final message: max_tokens reached, EOS, a stop): it
  // ends so at its first token, without it.
  std::optional<FinishReason> ended;

  std::string sid;
  bool ephemeral = false;
  bool prepared = false;
  bool started = false;
  bool done = false;
  bool decoding = false;         // the prompt is in the cache; pending holds the sampled token
  bool created_session = false;  // Prepare created the (named) session for this request
  bool had_session = false;      // the engine knew the session before this request (see Finish)
  int64_t closed_turn = 0;       // close_turn tokens Prepare put before the input
  // An APPEND's context, once Prepare dropped what tokens_read drops, ended inside
  // an open reply: so it does again after a tokens_read = 0 drops this request.
  bool reply_open_at_start = false;
  std::vector<int32_t> context;     // every token of the conversation so far
  std::vector<int32_t> pending;     // tokens of `context` without K/V yet, in order
  int64_t prefix_restored = 0;      // of the cached tokens attached before it started, from tier 1
  int64_t admitted_at_prefill = 0;  // its tenant's tenant_prefilled_ when it was admitted
  int64_t prefilled = 0;            // prompt tokens computed for it (its own part of that count)
  // Context positions [0, reached) had their K/V computed, or taken from the
  // cache, for this request at least once: computing one of them again is a
  // recompute (pressure took it), and finding it in the cache again is no new
  // cached token.
  int64_t reached = 0;
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
  if (options.default_max_tokens > options.max_tokens_per_request) {
    // The operator's cap holds for requests that leave max_tokens to the server.
    KV_LOG_WARN("default max_tokens {} is above the per-request limit {}; using {}",
                options.default_max_tokens, options.max_tokens_per_request, options.max_tokens_per_request);
    options.default_max_tokens = options.max_tokens_per_request;
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

absl::Status Engine::CheckKnown(const std::string& key, const std::string& id) const {
  if (!sessions_.contains(key)) return absl::NotFoundError(absl::StrCat("session '", id, "' not found"));
  return absl::OkStatus();
}

void Engine::AddSessionLocked(const std::string& key, SessionState state) {
  auto [it, inserted] = sessions_.insert_or_assign(key, std::move(state));
  if (inserted) ++tenant_sessions_[it->second.tenant];
}

void Engine::EraseSessionLocked(const std::string& key) {
  auto it = sessions_.find(key);
  if (it == sessions_.end()) return;
  if (--tenant_sessions_[it->second.tenant] <= 0) tenant_sessions_.erase(it->second.tenant);
  sessions_.erase(it);
}

absl::StatusOr<uint64_t> Engine::Submit(GenerateRequest request, GenerateObserver* observer) {
  if (observer == nullptr) return absl::InvalidArgumentError("no observer");
  const bool append = request.mode == RequestMode::kAppend;
  // An APPEND that goes on its session's cut reply adds nothing of its own.
  const bool goes_on = append && request.continued > 0;
  if (request.input.empty() && !goes_on) return absl::InvalidArgumentError("input is empty (no tokens)");
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
  if (append && request.session_id.empty()) return absl::InvalidArgumentError("APPEND needs a session_id");
  if (request.continued < 0 || (!append && request.continued > static_cast<int64_t>(request.input.size())) ||
      (goes_on && (!request.input.empty() || request.tokens_read >= 0 || request.request_id.empty()))) {
    return absl::InvalidArgumentError(
        absl::StrCat("continued ", request.continued,
                     " tokens must be within a FULL_CONTEXT input, or go on an APPEND "
                     "session's last reply, naming its request_id, with no input nor tokens_read"));
  }
  const int max_tokens = request.max_tokens == 0 ? options_.default_max_tokens : request.max_tokens;

  const std::string& sid = request.session_id;
  const std::string key = sid.empty() ? std::string() : kv::SessionKey(request.tenant, sid);
  absl::MutexLock lock(&mu_);
  // A client that says how much of its last reply it read (tokens_read) is
  // continuing after a "stop generating": its cancel was sent, and may only be
  // late (a loaded worker, or a router in between), so wait for it longer.
  const absl::Duration cancel_grace = request.tokens_read >= 0 ? kCancelledRequestWait : kCancelGrace;
  const bool busy = !key.empty() && AwaitHolderLocked(key, cancel_grace);
  if (append && !sessions_.contains(key) && kv_->GetSession(key).ok()) {
    // An imported session whose pages are in the cache, not yet adopted
    // (FinishImport): its cache events may reach a router, and the router this
    // request, first. The adoption is a moment away: wait for it.
    auto adopted = [this, &key]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return sessions_.contains(key); };
    mu_.AwaitWithTimeout(absl::Condition(&adopted), absl::Seconds(1));
  }
  // A tenant at its request limit may have cancelled one a moment ago ("stop
  // generating", then a new request): the cancel travels apart from this
  // request and often lands just after it. Wait for it as a session's next
  // request does, one request of a tenant at a time, so that a flooding
  // tenant holds at most one server thread here.
  if (OverRequestLimitLocked(request.tenant) && limit_waiters_.insert(request.tenant).second) {
    auto room = [this, &request]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return stopping_ || !OverRequestLimitLocked(request.tenant);
    };
    mu_.AwaitWithTimeout(absl::Condition(&room), cancel_grace);
    limit_waiters_.erase(request.tenant);
  }
  if (stopping_) return absl::UnavailableError("engine is stopping");
  int64_t context = static_cast<int64_t>(request.input.size());
  std::vector<int32_t> carried;  // the request's own output so far (continued)
  if (!append) carried.assign(request.input.end() - request.continued, request.input.end());
  if (!sid.empty()) {
    if (busy || busy_.contains(key)) {
      return absl::AbortedError(absl::StrCat("session '", sid, "' is busy with ", BusyWithLocked(key)));
    }
    if (append) {
      KVCACHE_RETURN_IF_ERROR(CheckKnown(key, sid));
      const SessionState& held = sessions_.find(key)->second;
      // Only the cut request's reply goes on: another request on the session
      // since (a second client's turn, say, while a drain moved it) made the
      // conversation another one.
      if (goes_on && held.last_request_id != request.request_id) {
        return absl::AbortedError(absl::StrCat("session '", sid, "' changed since request '",
                                               request.request_id,
                                               "' was cut: its last request is another one, so that reply "
                                               "cannot go on (it keeps the tokens sent)"));
      }
      // Going on the reply keeps what the client has of it, as tokens_read does.
      if (goes_on) request.tokens_read = request.continued;
      if (request.tokens_read > held.last_reply) {
        return absl::InvalidArgumentError(absl::StrCat(goes_on ? "continued " : "tokens_read ",
                                                       request.tokens_read, " exceeds the ", held.last_reply,
                                                       " tokens of the last reply of session '", sid, "'"));
      }
      const int64_t unread = DropFor(request, held).unread;
      const auto kept_end = held.context.end() - unread;
      carried.assign(kept_end - request.continued, kept_end);
      context += static_cast<int64_t>(held.context.size()) - unread +
                 (goes_on ? 0 : static_cast<int64_t>(request.close_turn.size()));
    }
  }
  if (context >= options_.max_context) {
    // OUT_OF_RANGE, as a context over tier 0: never here, but a worker with a
    // longer --max_context may take it (a router tries the next one).
    return absl::OutOfRangeError(absl::StrCat("context of ", context, " tokens leaves no room under the ",
                                              options_.max_context, "-token limit"));
  }
  // The whole context must fit in tier 0 at once (attention reads it there).
  // Its first token needs no page of its own: it ends the request when its K/V
  // would not fit (OutgrowsTier0), with FINISH_REASON_CONTEXT_FULL.
  const int64_t pages = (context + page_tokens_ - 1) / page_tokens_;
  // Never, on this worker: OUT_OF_RANGE, not the RESOURCE_EXHAUSTED of a full
  // moment (which clients retry).
  if (pages > kv_->tier_capacity_pages(0)) {
    return absl::OutOfRangeError(absl::StrCat(kContextOverTier0Message, ": ", context, " tokens need ", pages,
                                              " KV pages, and it holds ", kv_->tier_capacity_pages(0),
                                              " (--tier0_bytes)"));
  }
  const TenantLimits& limits = options_.tenant_limits;
  if (OverRequestLimitLocked(request.tenant)) {
    return absl::ResourceExhaustedError(absl::StrCat("tenant '", request.tenant, "' has ",
                                                     limits.max_requests, " requests in flight (its limit)"));
  }
  if (!sid.empty() && !sessions_.contains(key)) KVCACHE_RETURN_IF_ERROR(CheckSessionQuota(request.tenant));
  // A request that pins its session, or runs on a pinned one, may leave the
  // session as large as its context and max_tokens: that must fit the quota.
  bool session_pinned = false;
  if (options_.tenant_limits.max_pinned_pages > 0 && !sid.empty() && sessions_.contains(key)) {
    auto info = kv_->GetSession(key);
    session_pinned = info.ok() && info->user_pinned;
  }
  if (request.pin || session_pinned) {
    const int64_t need = (context + max_tokens + page_tokens_ - 1) / page_tokens_;
    KVCACHE_RETURN_IF_ERROR(CheckPinQuota(request.tenant, key, need));
  }
  // Checked after every error a retry cannot cure: a full queue takes the
  // request only by pushing out another tenant's (see PushOutCandidateLocked).
  std::optional<std::pair<uint64_t, std::string>> push_out;
  if (static_cast<int>(waiting_.size()) >= options_.max_waiting) {
    if (const int queued = QueuedLocked(); queued >= options_.max_waiting) {
      push_out = PushOutCandidateLocked(request.tenant);
      if (!push_out) return absl::ResourceExhaustedError(absl::StrCat("queue full (", queued, " waiting)"));
    }
  }
  const uint64_t id = next_request_id_++;
  live_.emplace(id, Live{request.deadline, request.tenant});
  if (!sid.empty()) {
    busy_.emplace(key, id);
    if (auto it = sessions_.find(key); it != sessions_.end()) it->second.last_used = absl::Now();
  }
  if (push_out) {  // leaves the queue at the engine thread's next turn, like a cancelled one
    cancelled_.insert_or_assign(
        push_out->first,
        absl::ResourceExhaustedError(
            absl::StrCat("queue full (", options_.max_waiting, " waiting): tenant '", push_out->second,
                         "' held the most of it, and its newest request made room for another tenant's")));
  }
  ++inflight_[request.tenant];
  waiting_.push_back(
      std::make_unique<Request>(id, std::move(request), observer, tokenizer_, max_tokens, carried));
  load_.waiting = static_cast<int>(waiting_.size());
  wake_.Signal();
  return id;
}

bool Engine::OverRequestLimitLocked(const std::string& tenant) const {
  const int limit = options_.tenant_limits.max_requests;
  auto in = inflight_.find(tenant);
  if (limit <= 0 || in == inflight_.end() || in->second < limit) return false;
  // Requests that were cancelled or passed their deadline, queued or running,
  // leave at the engine thread's next turn or step boundary: their quota is
  // already given back.
  const absl::Time now = absl::Now();
  int leaving = 0;
  for (const auto& [id, live] : live_) {
    leaving += live.tenant == tenant && (cancelled_.contains(id) || now > live.deadline);
  }
  return in->second - leaving >= limit;
}

bool Engine::LeavingLocked(const Request& r, absl::Time now) const {
  return cancelled_.contains(r.id) || now > r.req.deadline;
}

int Engine::QueuedLocked() const {
  const absl::Time now = absl::Now();
  int queued = 0;
  for (const auto& r : waiting_) queued += !LeavingLocked(*r, now);
  return queued;
}

std::optional<std::pair<uint64_t, std::string>> Engine::PushOutCandidateLocked(
    const std::string& tenant) const {
  const absl::Time now = absl::Now();
  absl::flat_hash_map<absl::string_view, int> queued;
  for (const auto& r : waiting_) queued[r->req.tenant] += !LeavingLocked(*r, now);
  auto most = queued.begin();
  for (auto it = queued.begin(); it != queued.end(); ++it) {
    if (it->second > most->second) most = it;
  }
  auto own = queued.find(tenant);
  // After the swap the fullest tenant must still hold at least as many as this
  // one, or two tenants would push each other out.
  if (most == queued.end() || most->second < (own == queued.end() ? 0 : own->second) + 2) return std::nullopt;
  for (auto it = waiting_.rbegin(); it != waiting_.rend(); ++it) {
    if ((*it)->req.tenant == most->first && !LeavingLocked(**it, now)) {
      return std::make_pair((*it)->id, (*it)->req.tenant);
    }
  }
  return std::nullopt;
}

void Engine::Cancel(uint64_t request_id) {
  absl::MutexLock lock(&mu_);
  if (!live_.contains(request_id)) return;  // done already (or never submitted)
  cancelled_.emplace(request_id, absl::CancelledError("request cancelled"));
  wake_.Signal();
}

int Engine::CutRequests(const absl::Status& status) {
  absl::MutexLock lock(&mu_);
  for (const auto& [id, deadline] : live_) cancelled_.insert_or_assign(id, status);
  wake_.Signal();
  return static_cast<int>(live_.size());
}

size_t Engine::tracked_request_ids() const {
  absl::MutexLock lock(&mu_);
  return live_.size() + cancelled_.size();
}

bool Engine::Prepare(Request& r) {
  r.prepared = true;
  const GenerateRequest& q = r.req;
  absl::Status st;
  if (q.session_id.empty()) {
    r.ephemeral = true;
    r.sid = absl::StrCat("~ephemeral-", ++ephemeral_counter_);
  } else {
    r.sid = kv::SessionKey(q.tenant, q.session_id);
  }
  std::vector<int32_t> known;  // the context the engine holds for the session
  bool exists = false;
  int64_t unread = 0;       // tokens of its last reply that the client says it did not read
  bool reply_open = false;  // what is kept ends inside a reply that stopped without its end of turn
  {
    absl::MutexLock lock(&mu_);
    auto it = sessions_.find(r.sid);
    if (it != sessions_.end()) {
      const SessionState& held = it->second;
      exists = true;
      known = held.context;
      const SessionDrop drop = DropFor(q, held);
      unread = drop.unread;
      reply_open = drop.reply_open;
    }
  }
  r.had_session = exists;
  if (q.mode == RequestMode::kAppend) {
    if (!exists) {  // closed between Submit and now
      Finish(r, absl::NotFoundError(absl::StrCat("session '", q.session_id, "' not found")), std::nullopt);
      return false;
    }
    r.context = std::move(known);
    r.context.resize(r.context.size() - static_cast<size_t>(unread));
    r.reply_open_at_start = reply_open;
    // A request that goes on the cut reply leaves its turn open.
    if (reply_open && q.continued == 0 && !r.context.empty() && !IsEndOfGeneration(r.context.back())) {
      r.context.insert(r.context.end(), q.close_turn.begin(), q.close_turn.end());
      r.closed_turn = static_cast<int64_t>(q.close_turn.size());
    }
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
    // The prefix cache may hold more of a resent prompt than the session does
    // (pages another session of the tenant computed): cut the session back to a
    // page boundary, where the first step joins them (JoinCachedPrefix) instead
    // of computing them again. A session cut at a boundary already gets that.
    if (exists && q.mode == RequestMode::kFullContext && cached % page_tokens_ != 0 &&
        kv_->LookupPrefix(q.tenant, absl::MakeConstSpan(r.context.data(), r.context.size() - 1)) > cached) {
      const int64_t boundary = cached / page_tokens_ * page_tokens_;
      if (kv_->Truncate(r.sid, boundary).ok()) cached = boundary;
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
    auto attached = kv_->AttachPrefix(r.sid, absl::MakeConstSpan(r.context.data(), r.context.size() - 1),
                                      &r.prefix_restored);
    cached = attached.ok() ? *attached : 0;
    absl::MutexLock lock(&mu_);
    // A session the engine knows keeps its entry (and its context, until Finish).
    if (!r.had_session) AddSessionLocked(r.sid, SessionState{q.tenant, r.context, absl::Now()});
    r.created_session = !r.ephemeral;
  }
  r.pending.assign(r.context.begin() + cached, r.context.end());
  r.result.session_id = q.session_id;
  r.result.cached_tokens = cached;
  r.reached = cached;
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
  // A request that created its session and failed before its first token leaves
  // no session behind: the client was told it failed, and an empty session would
  // hold one of the tenant's session slots until --session_idle_ttl.
  const bool failed_silent = !status.ok() && r.result.output.empty();
  const bool discard = r.created_session && !r.had_session && failed_silent;
  // A request that failed before its first token on a session that existed
  // leaves the session's conversation as it was (sessions_ still holds it: a
  // client that retries the turn must not find its input there twice), and the
  // cache holds K/V for a prefix of that conversation again: it is cut back to
  // what the two share (a sliding window that released those pages keeps the
  // request's context).
  bool revert = r.prepared && r.had_session && failed_silent;
  if (revert && kv_->GetSession(r.sid).ok()) {
    std::vector<int32_t> previous;
    {
      absl::MutexLock lock(&mu_);
      if (auto it = sessions_.find(r.sid); it != sessions_.end()) previous = it->second.context;
    }
    absl::StatusOr<std::vector<int32_t>> held = kv_->GetTokens(r.sid);
    size_t lcp = 0;
    if (held.ok()) {
      const size_t limit = std::min(held->size(), previous.size());
      while (lcp < limit && (*held)[lcp] == previous[lcp]) ++lcp;
    }
    revert = held.ok() && (lcp == held->size() || kv_->Truncate(r.sid, static_cast<int64_t>(lcp)).ok());
  }
  if (r.prepared && !r.sid.empty()) {
    if (r.ephemeral || discard) {
      (void)kv_->CloseSession(r.sid);
    } else if (kv_->GetSession(r.sid).ok()) {
      (void)kv_->MarkIdle(r.sid);
      // Pinned once it holds what the request sent: a cancel after tokens too.
      if (r.req.pin && !failed_silent) (void)kv_->PinSession(r.sid);
    }
  }
  {
    absl::MutexLock lock(&mu_);
    if (!r.req.session_id.empty()) busy_.erase(kv::SessionKey(r.req.tenant, r.req.session_id));
    if (holder_waiters_ > 0 && cancelled_.contains(r.id)) ended_cancelled_.insert(r.id);
    cancelled_.erase(r.id);
    live_.erase(r.id);
    if (--inflight_[r.req.tenant] <= 0) inflight_.erase(r.req.tenant);
    if (r.prepared && (r.ephemeral || discard)) {
      EraseSessionLocked(r.sid);
    } else if (r.prepared) {
      auto it = sessions_.find(r.sid);
      if (it != sessions_.end()) {
        SessionState& held = it->second;
        if (!revert) {
          const bool append = r.req.mode == RequestMode::kAppend;
          const bool goes_on = append && r.req.continued > 0;
          // A continued stream's reply began on the worker it came from (or
          // in the cut request this one goes on).
          const int64_t output = static_cast<int64_t>(r.result.output.size());
          const int64_t reply = output + r.req.continued;
          // The cut request and this one are one request: what it added, less
          // the part of its reply this one dropped, and this one's tokens.
          const int64_t added =
              goes_on ? std::max(reply, held.last_request - (held.last_reply - r.req.continued) + output)
                      : reply + (append ? static_cast<int64_t>(r.req.input.size()) + r.closed_turn : 0);
          held.context = r.context;
          held.last_reply = std::min(reply, static_cast<int64_t>(held.context.size()));
          held.last_request = std::min(added, static_cast<int64_t>(held.context.size()));
          // What a tokens_read = 0 after it goes back to: the context as this
          // request found it once its own tokens_read had cut it (a reply cut
          // short is open even when the whole reply had ended its turn); the
          // cut request's, for one that goes on it.
          if (!goes_on) held.reply_open_before = append && r.reply_open_at_start;
          held.reply_open = reply > 0 && !IsEndOfGeneration(held.context.back());
          held.ended_early.reset();
          held.last_request_id = r.req.request_id;
        } else {
          held.ended_early = DropFor(r.req, held);  // it left the session as it was
        }
        held.last_used = now;
      }
    } else if (!r.req.session_id.empty()) {
      // Ended in the queue (cancelled, past its deadline, pushed out): the
      // session is as it was, and this was its last request.
      auto it = sessions_.find(kv::SessionKey(r.req.tenant, r.req.session_id));
      if (it != sessions_.end()) it->second.ended_early = DropFor(r.req, it->second);
    }
  }
  r.observer->OnDone(status, r.result);
}

bool Engine::OutgrowsTier0(const Request& r) const {
  // The K/V of the sampled token would need more pages than tier 0 has: the
  // request could never take another step here, alone or not. Ending it now, as
  // at --max_context, keeps two such requests from taking the tier from each
  // other in turn (each preempting the other to recompute, neither growing).
  const int64_t capacity = kv_->tier_capacity_pages(0);
  const int64_t pages = (static_cast<int64_t>(r.context.size()) + page_tokens_ - 1) / page_tokens_;
  if (pages <= capacity) return false;
  // A sliding window releases pages before the window: only live ones count.
  absl::StatusOr<kv::SessionInfo> info = kv_->GetSession(r.sid);
  return !info.ok() || pages - info->first_live_page > capacity;
}

absl::StatusOr<kv::StepReservation> Engine::Reserve(Request& r, int budget) {
  // The engine is the authority on a request's context; the cache holds K/V for
  // a prefix of it. Pressure (a running session preempted without tier-1 room,
  // tier-1 pages dropped, a corrupt page on restore) can shorten that prefix
  // between steps. Every reservation is checked against what the engine expects,
  // and anything the cache lost is computed again from the context before the
  // request goes on: it never continues at a position the cache no longer holds.
  for (int attempt = 0;; ++attempt) {
    const int64_t expected = static_cast<int64_t>(r.context.size() - r.pending.size());
    const int n = std::min<int>(budget, static_cast<int>(r.pending.size()));
    absl::StatusOr<kv::StepReservation> res = kv_->BeginStep(r.sid, n);
    int64_t held;
    if (res.ok()) {
      if (res->first_pos == expected) return res;
      held = res->first_pos;
      (void)kv_->AbortStep(r.sid);
    } else if (absl::IsDataLoss(res.status())) {
      KV_LOG_WARN("session '{}': {}; recomputing it", r.req.session_id, res.status().ToString());
      auto info = kv_->GetSession(r.sid);
      if (!info.ok()) return info.status();
      held = info->num_tokens;
    } else {
      return res.status();
    }
    if (held > expected || attempt > 0) {
      return absl::InternalError(absl::StrCat("session '", r.req.session_id, "': the KV cache holds ", held,
                                              " tokens where the engine expects ", expected));
    }
    KVCACHE_RETURN_IF_ERROR(Resync(r, held));
  }
}

absl::Status Engine::Resync(Request& r, int64_t held) {
  KVCACHE_ASSIGN_OR_RETURN(std::vector<int32_t> tokens, kv_->GetTokens(r.sid));
  // What the cache kept must be a prefix of the context (it only ever stores what
  // the engine committed); keep the part that is, drop the rest.
  size_t keep = 0;
  const size_t limit = std::min<size_t>({tokens.size(), static_cast<size_t>(held), r.context.size() - 1});
  while (keep < limit && tokens[keep] == r.context[keep]) ++keep;
  if (keep < tokens.size()) KVCACHE_RETURN_IF_ERROR(kv_->Truncate(r.sid, static_cast<int64_t>(keep)));
  KV_LOG_DEBUG("session '{}': the KV cache lost tokens {}..{}; recomputing them", r.req.session_id, keep,
               r.context.size() - r.pending.size());
  r.pending.assign(r.context.begin() + static_cast<std::ptrdiff_t>(keep), r.context.end());
  r.decoding = false;  // a prefill again until the pending tokens are in the cache
  if (!r.started) {    // what it lost before its first step was never its own
    r.result.cached_tokens = std::min<int64_t>(r.result.cached_tokens, static_cast<int64_t>(keep));
    r.reached = std::min<int64_t>(r.reached, static_cast<int64_t>(keep));
  }
  return absl::OkStatus();
}

int64_t Engine::JoinCachedPrefix(Request& r) {
  const int64_t pos = static_cast<int64_t>(r.context.size() - r.pending.size());
  if (!r.result.output.empty() || pos % page_tokens_ != 0 ||
      static_cast<int64_t>(r.pending.size()) <= page_tokens_) {
    return 0;
  }
  // The cache may hold less than the engine expects (pages lost under pressure):
  // Reserve recomputes those first.
  absl::StatusOr<int64_t> held = kv_->NumTokens(r.sid);
  if (!held.ok() || *held != pos) return 0;
  int64_t restored = 0;
  absl::StatusOr<int64_t> hit =
      kv_->AttachPrefix(r.sid, absl::MakeConstSpan(r.context.data(), r.context.size() - 1), &restored);
  if (!hit.ok() || *hit == 0) return 0;
  r.pending.erase(r.pending.begin(), r.pending.begin() + *hit);
  // Positions it had reached were lost under pressure and are found again: not
  // new cached tokens (nor recomputed ones).
  const int64_t again = std::clamp<int64_t>(r.reached - pos, 0, *hit);
  r.result.cached_tokens += *hit - again;
  r.reached = std::max(r.reached, pos + *hit);
  if (r.started) {
    r.result.restored_tokens += restored;
  } else {
    r.prefix_restored += restored;
  }
  return *hit;
}

bool Engine::AwaitsSharedPrefill(const Request& r, const std::vector<const Request*>& planned) const {
  const size_t pos = r.context.size() - r.pending.size();
  const size_t page_end = pos + static_cast<size_t>(page_tokens_);
  // Only a full page before the prompt's last token can be shared (AttachPrefix).
  if (pos % page_tokens_ != 0 || page_end >= r.context.size()) return false;
  for (const Request* a : planned) {
    if (a == &r || a->decoding || a->req.tenant != r.req.tenant) continue;
    const size_t a_pos = a->context.size() - a->pending.size();
    if (a_pos > pos || a->context.size() < page_end) continue;
    // The page itself first: it tells most requests apart in page_tokens
    // comparisons, so only a sharer pays for comparing the whole prefix.
    const auto r_begin = r.context.begin();
    const auto a_begin = a->context.begin();
    const auto p = static_cast<std::ptrdiff_t>(pos);
    const auto e = static_cast<std::ptrdiff_t>(page_end);
    if (std::equal(r_begin + p, r_begin + e, a_begin + p) && std::equal(r_begin, r_begin + p, a_begin)) {
      return true;
    }
  }
  return false;
}

// Prompt tokens of others' work per token of a waiting prompt's aging (see
// Step). In the multi-round QA load (shape b, two runs each) 1 raised the median
// time to first token over shortest-first alone from 1.06-1.11 s to 1.77-1.88 s
// while cutting p99 from 8.7-8.9 s to 5.8-6.0 s; 2 kept the median (0.86-0.97 s,
// p99 7.8-8.9 s) and still bounds every prompt's wait.
constexpr int64_t kPromptAgingTokens = 2;

void Engine::TrackTenantPrefill() {
  absl::flat_hash_set<absl::string_view> tenants, running;  // with a prompt to compute; with any request
  for (const auto& r : active_) {
    running.insert(r->req.tenant);
    if (r->prepared && !r->done && !r->decoding && !r->pending.empty()) tenants.insert(r->req.tenant);
  }
  absl::erase_if(tenant_prefilled_, [&running](const auto& entry) { return !running.contains(entry.first); });
  absl::erase_if(prefill_served_, [&tenants](const auto& entry) { return !tenants.contains(entry.first); });
  // A tenant that starts waiting starts level with the least served one, so it
  // neither waits behind others' past work nor takes the next ones outright.
  int64_t least = prefill_served_.empty() ? 0 : std::numeric_limits<int64_t>::max();
  for (const auto& entry : prefill_served_) least = std::min(least, entry.second);
  for (absl::string_view tenant : tenants) {
    if (!prefill_served_.contains(tenant)) prefill_served_.emplace(std::string(tenant), least);
  }
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
  std::vector<const Request*> planned_prefills;
  StepShape shape;
  int64_t recomputed = 0;
  int64_t joined = 0;
  // Seconds left for prefill in this step; infinite while nothing decodes (no
  // stream waits on this step) or when there is no target.
  double prefill_seconds = HUGE_VAL;
  absl::flat_hash_set<const Request*> planned;  // a decode that must recompute turns into a prefill
  // Decode first: one token per request past its prompt; then prefill chunks.
  for (int pass = 0; pass < 2 && budget > 0; ++pass) {
    if (pass == 1 && shape.decode_tokens > 0 && options_.max_step_time >= absl::ZeroDuration() &&
        step_cost_.ready()) {
      const double decodes = absl::ToDoubleSeconds(step_cost_.Predict(shape));
      const double target = options_.max_step_time > absl::ZeroDuration()
                                ? absl::ToDoubleSeconds(options_.max_step_time)
                                : kAutoStepTimeFactor * decodes;
      prefill_seconds = target - decodes;
    }
    // Decodes in admission order; prompts of the least served tenant first (see
    // TrackTenantPrefill), and within a tenant shortest remaining first, so that a
    // conversation's short next turn is not queued behind a long cold prompt, aged
    // by the tenant's prompt work done since each arrived (ties: oldest): a prompt
    // counts as one token shorter for every kPromptAgingTokens prompt tokens the
    // engine computes for its tenant's other requests after admitting it, so a
    // long prompt waits at most about that many times its own length in its
    // tenant's other prompts' work (shortest-first alone starves it while shorter
    // turns keep arriving). Its own progress shortens it already and is not
    // waiting: counted as aging, a cold prompt a third of its way in would go
    // before every next turn that arrives while it runs. Before all of them, a
    // prompt whose last chunk ended inside a page (the step-time target left less
    // than a page) goes on to that page's end: fairness between tenants then
    // moves a page at a time. A few tokens at a time, round robin, every waiting
    // prompt finished only when nearly all had: beside one stream on an Intel Xeon
    // (SmolLM2, avx512), 3 tokens a step went to 15 prompts of 16 tokens in turn,
    // and their first tokens came after 264-337 ms (median; engine_bench arrivals,
    // three runs); a page at a time, 183-200 ms (the last still 355-375 ms: the
    // same tokens fit in the same steps), the stream's gaps unchanged.
    std::vector<Request*> order;
    if (pass == 0) {
      for (auto& rp : active_) order.push_back(rp.get());
    } else {
      TrackTenantPrefill();
      std::vector<std::pair<std::tuple<bool, int64_t, int64_t>, Request*>> keyed;
      for (auto& rp : active_) {
        const Request& r = *rp;
        const int64_t pos = static_cast<int64_t>(r.context.size() - r.pending.size());
        const bool inside_a_page = r.prefilled > 0 && pos % page_tokens_ != 0;
        auto served = prefill_served_.find(r.req.tenant);
        auto computed = tenant_prefilled_.find(r.req.tenant);
        // The tenant's prompt tokens computed for others since it was admitted.
        const int64_t waited = (computed == tenant_prefilled_.end() ? 0 : computed->second) -
                               r.admitted_at_prefill - r.prefilled;
        keyed.push_back({{!inside_a_page, served == prefill_served_.end() ? 0 : served->second,
                          kPromptAgingTokens * static_cast<int64_t>(r.pending.size()) - waited},
                         rp.get()});
      }
      std::stable_sort(keyed.begin(), keyed.end(),
                       [](const auto& a, const auto& b) { return a.first < b.first; });
      for (const auto& k : keyed) order.push_back(k.second);
    }
    for (Request* rp : order) {
      Request& r = *rp;
      if (r.done || !r.prepared || r.decoding != (pass == 0) || r.pending.empty() || budget == 0) continue;
      if (planned.contains(&r)) continue;
      int limit = budget;
      if (pass == 1) {
        joined += JoinCachedPrefix(r);
        if (AwaitsSharedPrefill(r, planned_prefills)) continue;
        const int64_t pos = static_cast<int64_t>(r.context.size() - r.pending.size());
        if (prefill_seconds != HUGE_VAL) {
          const double fit = std::floor(std::max(prefill_seconds, 0.0) / step_cost_.PrefillTokenSeconds(pos));
          // Every step moves prefill on by at least one token.
          const double floor_tokens = planned_prefills.empty() ? 1 : 0;
          limit = static_cast<int>(std::min<double>(limit, std::max(fit, floor_tokens)));
          if (limit == 0) continue;
        }
        // End a partial chunk on a page boundary, so that its pages are published
        // (and shareable) when it commits and the next chunk can join cached ones.
        if (limit < static_cast<int>(r.pending.size())) {
          const int64_t end = (pos + limit) / page_tokens_ * page_tokens_;
          if (end > pos) {
            limit = static_cast<int>(end - pos);
          } else if (!planned_prefills.empty()) {
            continue;  // less than a page left in this step, and others used it
          }
        }
      }
      absl::StatusOr<kv::StepReservation> res = Reserve(r, limit);
      if (!res.ok()) {
        if (res.status().code() == absl::StatusCode::kResourceExhausted) continue;  // wait for room
        Finish(r, res.status(), std::nullopt);
        continue;
      }
      const int n = static_cast<int>(res->num_new_tokens);
      const int64_t again = std::clamp<int64_t>(r.reached - res->first_pos, 0, n);  // pressure took them
      recomputed += again;
      r.result.recomputed_tokens += again;
      r.reached = std::max(r.reached, res->first_pos + n);
      if (!r.started) {
        r.started = true;
        r.result.queue_time = absl::Now() - r.submitted;
        r.result.restored_tokens =
            std::min<int64_t>(res->restored_pages * page_tokens_ + r.prefix_restored, r.result.cached_tokens);
      }
      budget -= n;
      planned.insert(&r);
      if (r.decoding) {
        shape.decode_tokens += n;
        shape.decode_context += res->first_pos;
      } else {
        shape.prefill_tokens += n;
        shape.prefill_attention += static_cast<double>(n) * (static_cast<double>(res->first_pos) + n / 2.0);
        planned_prefills.push_back(&r);
        prefill_served_[r.req.tenant] += n;
        tenant_prefilled_[r.req.tenant] += n;
        r.prefilled += n;
        if (prefill_seconds != HUGE_VAL) {
          prefill_seconds -= n * step_cost_.PrefillTokenSeconds(res->first_pos + n / 2);
        }
      }
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
  const absl::Time forward_start = absl::Now();
  absl::StatusOr<absl::Span<const float>> logits = runner_->ForwardView(batch);
  const absl::Duration forward_took = absl::Now() - forward_start;
  absl::Status st = logits.status();
  if (!st.ok()) {
    KV_LOG_ERROR("forward step failed: {}", st.ToString());
    for (Planned& p : plan) {
      (void)kv_->AbortStep(p.r->sid);
      Finish(*p.r, absl::InternalError(absl::StrCat("model step failed: ", st.message())), std::nullopt);
    }
    return true;
  }

  // Requests cancelled while the step ran (their client stopped reading, or a
  // drain cut them) and requests past their deadline end here without this
  // step's token: it would reach nobody, yet the session would keep it, and the
  // conversation would then hold a token its client never saw.
  absl::flat_hash_map<uint64_t, absl::Status> gone;
  {
    absl::MutexLock lock(&mu_);
    for (const Planned& p : plan) {
      if (auto it = cancelled_.find(p.r->id); it != cancelled_.end()) gone.emplace(it->first, it->second);
    }
  }
  const absl::Time forward_end = absl::Now();
  const int64_t vocab = runner_->hparams().n_vocab;
  // Every row's token first, on the runner's threads (each request owns its
  // sampler; a request that ends below without its token just drops it). Sampling
  // at temperature 1 walks the whole vocabulary's weights: on the engine thread
  // alone, 16 streams' took about a tenth of the step.
  std::vector<std::pair<size_t, int64_t>> rows;  // (plan index, logits row)
  for (size_t i = 0; i < plan.size(); ++i) {
    if (batch[i].want_logits) rows.emplace_back(i, static_cast<int64_t>(rows.size()));
  }
  std::vector<int32_t> sampled(plan.size(), -1);
  runner_->ParallelFor(static_cast<int64_t>(rows.size()), [&](int64_t j) {
    const auto [i, row] = rows[j];
    sampled[i] = plan[i].r->sampler.Sample(logits->subspan(row * vocab, static_cast<size_t>(vocab)));
  });
  for (size_t i = 0; i < plan.size(); ++i) {
    Request& r = *plan[i].r;
    const int n = plan[i].n;
    st = kv_->CommitStep(r.sid, absl::MakeConstSpan(r.pending.data(), n));
    if (!st.ok()) {
      Finish(r, st, std::nullopt);
      continue;
    }
    r.pending.erase(r.pending.begin(), r.pending.begin() + n);
    if (!batch[i].want_logits) continue;
    if (auto it = gone.find(r.id); it != gone.end()) {
      Finish(r, it->second, std::nullopt);
      continue;
    }
    if (forward_end > r.req.deadline) {
      Finish(r, absl::DeadlineExceededError("deadline passed before generation ended"), std::nullopt);
      continue;
    }
    if (r.ended.has_value()) {
      Finish(r, absl::OkStatus(), *r.ended);
      continue;
    }
    const int32_t token = sampled[i];
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
    } else if (static_cast<int64_t>(r.context.size()) >= options_.max_context || OutgrowsTier0(r)) {
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
  if (prefill_tokens > 0) {
    recent_prefill_.push_back(PrefillStep{end, prefill_tokens, end - start});
    recent_prefill_tokens_ += prefill_tokens;
    recent_prefill_time_ += end - start;
    while (end - recent_prefill_.front().end > absl::Seconds(10)) {
      recent_prefill_tokens_ -= recent_prefill_.front().tokens;
      recent_prefill_time_ -= recent_prefill_.front().took;
      recent_prefill_.pop_front();
    }
  }
  step_cost_.Observe(shape, end - start);
  if (end - last_cost_log_ > absl::Seconds(30) && step_cost_.ready()) {
    last_cost_log_ = end;
    const auto& c = step_cost_.coefficients();
    KV_LOG_INFO(
        "step model: {:.2f} ms per step + {:.3f} ms per decode + {:.3f} ms per 1k decode context + {:.3f} ms "
        "per prefill token + {:.3f} ms per 1M prefill attention pairs",
        c[0] * 1e3, c[1] * 1e3, c[2] * 1e3, c[3] * 1e3, c[4] * 1e3);
  }
  const model::ModelRunner::ForwardProfile profile = runner_->last_forward_profile();
  StepStats stats{static_cast<int>(plan.size()),
                  decode_tokens,
                  prefill_tokens,
                  end - start,
                  forward_took,
                  profile.products,
                  profile.attention,
                  recomputed,
                  joined};
  std::function<void(const StepStats&)> cb;
  {
    absl::MutexLock lock(&mu_);
    cb = step_callback_;
  }
  if (cb) cb(stats);
  return true;
}

void Engine::AdmitFairlyLocked(std::vector<std::unique_ptr<Request>>& admitted) {
  const int room = options_.max_running - static_cast<int>(active_.size());
  if (waiting_.empty() || room <= 0) return;
  struct Tenant {
    int running = 0;              // in active_ and `admitted`
    int64_t last_admitted = -1;   // -1: never (while it had requests here)
    std::vector<size_t> waiting;  // its indices in waiting_, in arrival order
    size_t next = 0;              // the first of them not admitted
  };
  absl::flat_hash_map<absl::string_view, Tenant> tenants;
  for (const auto& r : active_) ++tenants[r->req.tenant].running;
  for (size_t i = 0; i < waiting_.size(); ++i) tenants[waiting_[i]->req.tenant].waiting.push_back(i);
  for (auto& [name, t] : tenants) {
    if (auto it = last_admitted_.find(name); it != last_admitted_.end()) t.last_admitted = it->second;
  }
  for (int n = 0; n < room; ++n) {
    // The tenant with the fewest running, then the one admitted least recently,
    // then the one whose next request arrived first.
    Tenant* best = nullptr;
    absl::string_view best_name;
    for (auto& [name, t] : tenants) {
      if (t.next == t.waiting.size()) continue;
      if (best == nullptr ||
          std::make_tuple(t.running, t.last_admitted, t.waiting[t.next]) <
              std::make_tuple(best->running, best->last_admitted, best->waiting[best->next])) {
        best = &t;
        best_name = name;
      }
    }
    if (best == nullptr) break;  // nothing left to admit
    admitted.push_back(std::move(waiting_[best->waiting[best->next++]]));
    ++best->running;
    best->last_admitted = admissions_++;
    last_admitted_[best_name] = best->last_admitted;
  }
  waiting_.erase(std::remove(waiting_.begin(), waiting_.end(), nullptr), waiting_.end());
  // Forget tenants with nothing queued or running, so that the map stays as small
  // as the engine's requests; such a tenant that comes back counts as never admitted.
  absl::erase_if(last_admitted_, [&tenants](const auto& entry) {
    auto it = tenants.find(entry.first);
    return it == tenants.end() || (it->second.running == 0 && it->second.next == it->second.waiting.size());
  });
}

void Engine::Loop() {
  while (true) {
    std::vector<std::unique_ptr<Request>> admitted;
    std::vector<std::unique_ptr<Request>> expired;  // left the queue cancelled or late
    absl::flat_hash_map<uint64_t, absl::Status> cancelled;
    bool stopping;
    {
      absl::MutexLock lock(&mu_);
      const bool has_active = !active_.empty();
      auto ready = [this, has_active]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || has_active || !waiting_.empty();
      };
      if (options_.session_idle_ttl > absl::ZeroDuration()) {
        mu_.AwaitWithDeadline(absl::Condition(&ready), next_expiry_);
      } else {
        mu_.Await(absl::Condition(&ready));
      }
      stopping = stopping_;
      // Queued requests honour cancellation and deadlines at once: they give back
      // their queue slot, session and tenant quota without waiting for admission.
      const absl::Time now = absl::Now();
      for (auto it = waiting_.begin(); it != waiting_.end();) {
        if (LeavingLocked(**it, now)) {
          expired.push_back(std::move(*it));
          it = waiting_.erase(it);
        } else {
          ++it;
        }
      }
      AdmitFairlyLocked(admitted);
      if (stopping) {
        while (!waiting_.empty()) {
          admitted.push_back(std::move(waiting_.front()));
          waiting_.pop_front();
        }
      }
      cancelled = cancelled_;
    }
    if (!stopping && options_.session_idle_ttl > absl::ZeroDuration() && absl::Now() >= next_expiry_) {
      ExpireIdleSessions(absl::Now());
      next_expiry_ =
          absl::Now() + std::clamp(options_.session_idle_ttl / 8, absl::Milliseconds(10), absl::Seconds(1));
    }
    for (auto& r : expired) {
      auto it = cancelled.find(r->id);
      Finish(*r,
             it == cancelled.end()
                 ? absl::DeadlineExceededError("deadline passed while the request was queued")
             : it->second.code() == absl::StatusCode::kCancelled
                 ? absl::CancelledError("request cancelled while queued")
                 : it->second,
             std::nullopt);
    }
    for (auto& r : admitted) {
      r->admitted_at_prefill = tenant_prefilled_[r->req.tenant];
      active_.push_back(std::move(r));
    }
    const absl::Time now = absl::Now();
    for (auto& rp : active_) {
      Request& r = *rp;
      if (stopping) {
        Finish(r, absl::UnavailableError("worker is shutting down"), std::nullopt);
      } else if (auto it = cancelled.find(r.id); it != cancelled.end()) {
        Finish(r, it->second, std::nullopt);
      } else if (now > r.req.deadline) {
        Finish(r, absl::DeadlineExceededError("deadline passed before generation ended"), std::nullopt);
      } else if (!r.prepared) {
        Prepare(r);
      }
    }
    if (!stopping) {
      const bool progressed = Step();
      if (!progressed) {
        // Nothing fits (running requests and user-pinned sessions hold tier 0):
        // fail the newest request that has not sent a token yet, else the newest,
        // so that the others (and future requests) can make progress.
        Request* victim = nullptr;
        for (auto it = active_.rbegin(); it != active_.rend(); ++it) {
          if ((*it)->done) continue;
          if (victim == nullptr) victim = it->get();
          if ((*it)->result.output.empty()) {
            victim = it->get();
            break;
          }
        }
        // A context that outgrew tier 0 has ended already (OutgrowsTier0, after
        // each sampled token): this one would fit, but other holders of the tier
        // (pinned sessions, sessions moving in or out) leave it no page now. That
        // is no context limit, so not CONTEXT_FULL (a reply cut short as if it
        // were complete): RESOURCE_EXHAUSTED, which a router continues elsewhere.
        if (victim != nullptr) {
          Finish(*victim,
                 absl::ResourceExhaustedError(absl::StrCat(
                     kNoKvMemoryMessage,
                     victim->result.output.empty() ? " to start the request" : " for the context to grow",
                     ": tier 0 holds ", kv_->tier_capacity_pages(0), " pages (--tier0_bytes); ",
                     kv_->GetStats().tier[0].free_pages,
                     " are free, too few for this step, and the others are held by running requests, "
                     "pinned sessions and sessions moving in or out")),
                 std::nullopt);
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
      if (recent_prefill_time_ > absl::ZeroDuration()) {
        load_.prefill_tokens_per_second =
            recent_prefill_tokens_ / absl::ToDoubleSeconds(recent_prefill_time_);
      }
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

const char* Engine::BusyWithLocked(const std::string& key) const {
  auto it = busy_.find(key);
  return it != busy_.end() && it->second == 0
             ? "a session call (close, fork, pin, offload, restore, export or migration)"
             : "another request";
}

bool Engine::AwaitHolderLocked(const std::string& key, absl::Duration cancel_grace) {
  auto running = busy_.find(key);
  if (running == busy_.end()) return false;
  if (running->second == 0) {
    // A session call holds it: wait for it to end (the caller then sees the
    // session as that call left it: there, moved away or closed).
    auto released = [this, &key]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      auto it = busy_.find(key);
      return stopping_ || it == busy_.end() || it->second != 0;
    };
    mu_.AwaitWithTimeout(absl::Condition(&released), kSessionCallWait);
    return false;
  }
  const uint64_t id = running->second;
  auto holds = [this, &key, id]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = busy_.find(key);
    return it != busy_.end() && it->second == id;
  };
  // The cancel may come and the request end (its next step boundary) before
  // this thread runs again: ended_cancelled_ keeps what the wait must see.
  // A holder past its deadline is as good as cancelled: its client has its
  // DEADLINE_EXCEEDED already, and it leaves at the engine's next step.
  auto was_cancelled = [this, id]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto live = live_.find(id);
    return stopping_ || cancelled_.contains(id) || ended_cancelled_.contains(id) ||
           (live != live_.end() && absl::Now() >= live->second.deadline);
  };
  auto settled = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return was_cancelled() || !holds(); };
  ++holder_waiters_;
  mu_.AwaitWithTimeout(absl::Condition(&settled), cancel_grace);
  const bool cancelled = was_cancelled();
  if (--holder_waiters_ == 0) ended_cancelled_.clear();
  // Not cancelled in the grace, running still or ended on its own: ABORTED.
  if (!cancelled) return true;
  auto ended = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || !holds(); };
  mu_.AwaitWithTimeout(absl::Condition(&ended), kCancelledRequestWait);
  return false;
}

absl::Status Engine::Reserve(const std::string& id, const std::string& tenant) {
  absl::MutexLock lock(&mu_);
  const std::string key = kv::SessionKey(tenant, id);
  // A session whose first request is still queued is busy before it is known.
  if (AwaitHolderLocked(key, kCancelGrace) || busy_.contains(key))
    return absl::AbortedError(absl::StrCat("session '", id, "' is busy with ", BusyWithLocked(key)));
  KVCACHE_RETURN_IF_ERROR(CheckKnown(key, id));
  busy_.emplace(key, 0);
  return absl::OkStatus();
}

absl::Status Engine::ReserveWait(const std::string& id, const std::string& tenant, absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  const std::string key = kv::SessionKey(tenant, id);
  KVCACHE_RETURN_IF_ERROR(CheckKnown(key, id));
  auto free = [this, &key]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !busy_.contains(key); };
  if (!mu_.AwaitWithTimeout(absl::Condition(&free), timeout)) {
    return absl::AbortedError(
        absl::StrCat("session '", id, "' stayed busy for ", absl::FormatDuration(timeout)));
  }
  KVCACHE_RETURN_IF_ERROR(CheckKnown(key, id));  // it may have been closed meanwhile
  busy_.emplace(key, 0);
  return absl::OkStatus();
}

void Engine::Release(const std::string& id, const std::string& tenant) {
  absl::MutexLock lock(&mu_);
  busy_.erase(kv::SessionKey(tenant, id));
}

absl::Status Engine::CloseSession(const std::string& id, const std::string& tenant, int64_t* pages_freed) {
  KVCACHE_RETURN_IF_ERROR(Reserve(id, tenant));
  const std::string key = kv::SessionKey(tenant, id);
  if (pages_freed != nullptr) *pages_freed = 0;
  absl::Status st = kv_->CloseSession(key, pages_freed);
  if (st.code() == absl::StatusCode::kNotFound) st = absl::OkStatus();  // cache already lost it
  absl::MutexLock lock(&mu_);
  busy_.erase(key);
  if (st.ok()) EraseSessionLocked(key);
  return st;
}

absl::Status Engine::ForkSession(const std::string& id, const std::string& new_id,
                                 const std::string& tenant) {
  KVCACHE_RETURN_IF_ERROR(Reserve(id, tenant));
  const std::string key = kv::SessionKey(tenant, id);
  const std::string new_key = kv::SessionKey(tenant, new_id);
  SessionState copy;  // the conversation and what its last request was
  absl::Status st;
  {
    absl::MutexLock lock(&mu_);
    if (sessions_.contains(new_key) || busy_.contains(new_key)) {
      st = absl::AlreadyExistsError(absl::StrCat("session '", new_id, "' already exists"));
    } else if (st = CheckSessionQuota(tenant); st.ok()) {
      copy = sessions_.find(key)->second;
      copy.last_used = absl::Now();
      copy.exports = 0;
    }
  }
  if (st.ok()) st = kv_->Fork(key, new_key);
  absl::MutexLock lock(&mu_);
  busy_.erase(key);
  if (st.ok()) AddSessionLocked(new_key, std::move(copy));
  return st;
}

absl::Status Engine::CheckSessionQuota(const std::string& tenant) const {
  const int limit = options_.tenant_limits.max_sessions;
  if (limit <= 0) return absl::OkStatus();
  auto known = tenant_sessions_.find(tenant);
  int held = known == tenant_sessions_.end() ? 0 : known->second;
  // Queued requests that will create a session count too.
  for (const auto& r : waiting_) {
    held += r->req.tenant == tenant && !r->req.session_id.empty() &&
            !sessions_.contains(kv::SessionKey(r->req.tenant, r->req.session_id));
  }
  if (held >= limit) {
    return absl::ResourceExhaustedError(
        absl::StrCat("tenant '", tenant, "' holds ", held, " sessions (its limit is ", limit, ")"));
  }
  return absl::OkStatus();
}

absl::Status Engine::CheckPinQuota(const std::string& tenant, const std::string& key, int64_t pages) const {
  const int64_t limit = options_.tenant_limits.max_pinned_pages;
  if (limit <= 0) return absl::OkStatus();
  int64_t pinned = pages;
  for (const auto& [other, state] : sessions_) {
    if (state.tenant != tenant || other == key) continue;
    auto info = kv_->GetSession(other);
    if (info.ok() && info->user_pinned) pinned += info->tier0_pages + info->tier1_pages;
  }
  if (pinned > limit) {
    return absl::ResourceExhaustedError(
        absl::StrCat("tenant '", tenant, "' would pin ", pinned, " pages; its limit is ", limit));
  }
  return absl::OkStatus();
}

absl::Status Engine::SetPinned(const std::string& id, const std::string& tenant, bool pinned) {
  const std::string key = kv::SessionKey(tenant, id);
  if (pinned) {
    auto info = kv_->GetSession(key);
    absl::MutexLock lock(&mu_);
    KVCACHE_RETURN_IF_ERROR(CheckKnown(key, id));
    if (info.ok() && !info->user_pinned) {
      KVCACHE_RETURN_IF_ERROR(CheckPinQuota(tenant, key, info->tier0_pages + info->tier1_pages));
    }
  }
  KVCACHE_RETURN_IF_ERROR(Reserve(id, tenant));
  absl::Status st = pinned ? kv_->PinSession(key) : kv_->UnpinSession(key);
  Release(id, tenant);
  return st;
}

absl::Status Engine::Offload(const std::string& id, const std::string& tenant) {
  KVCACHE_RETURN_IF_ERROR(Reserve(id, tenant));
  absl::Status st = kv_->Offload(kv::SessionKey(tenant, id));
  Release(id, tenant);
  return st;
}

absl::Status Engine::Restore(const std::string& id, const std::string& tenant) {
  KVCACHE_RETURN_IF_ERROR(Reserve(id, tenant));
  absl::Status st = kv_->Restore(kv::SessionKey(tenant, id));
  Release(id, tenant);
  return st;
}

absl::StatusOr<std::vector<int32_t>> Engine::Context(const std::string& id, const std::string& tenant) const {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(kv::SessionKey(tenant, id));
  if (it == sessions_.end()) return absl::NotFoundError(absl::StrCat("session '", id, "' not found"));
  return it->second.context;
}

absl::StatusOr<SessionView> Engine::View(const std::string& id, const std::string& tenant) const {
  absl::MutexLock lock(&mu_);
  const std::string key = kv::SessionKey(tenant, id);
  auto it = sessions_.find(key);
  if (it == sessions_.end()) return absl::NotFoundError(absl::StrCat("session '", id, "' not found"));
  SessionView v;
  v.context_tokens = static_cast<int64_t>(it->second.context.size());
  v.last_reply_tokens = it->second.last_reply;
  v.last_request_tokens = it->second.last_request;
  v.last_used = it->second.last_used;
  v.reply_open = it->second.reply_open;
  v.reply_open_before = it->second.reply_open_before;
  v.ended_early = it->second.ended_early;
  v.last_request_id = it->second.last_request_id;
  v.exporting = it->second.exports > 0;
  v.busy = busy_.contains(key);
  return v;
}

absl::StatusOr<std::unique_ptr<kv::SessionImporter>> Engine::BeginImport() {
  return kv::SessionImporter::Create(kv_);
}

absl::Status Engine::CheckImportPin(const kv::SessionImporter& importer, const ImportedState& state) const {
  if (!state.pinned || state.unpin_over_quota) return absl::OkStatus();
  const std::string& key = importer.session_id();
  {
    absl::MutexLock lock(&mu_);
    KVCACHE_RETURN_IF_ERROR(CheckPinQuota(kv::SplitSessionKey(key).tenant, key, importer.staged_pages()));
  }
  // The pin restores the pages staged in tier 1 (tier 0 had no room for them then).
  const int64_t need = importer.staged_pages(1);
  if (need == 0) return absl::OkStatus();
  const int64_t freeable = kv_->Tier0PagesFreeable();
  if (need > freeable) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "pinned session '", kv::SplitSessionKey(key).id, "' needs ", need, " more tier-0 pages here, only ",
        freeable, " could be made free (the rest are pinned, running or being imported)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<kv::SessionName> Engine::FinishImport(const kv::SessionImporter& importer,
                                                     std::vector<int32_t> context,
                                                     const ImportedState& state) {
  const std::string& key = importer.session_id();
  const kv::SessionName name = kv::SplitSessionKey(key);
  auto adopt = [&]() -> absl::Status {
    KVCACHE_ASSIGN_OR_RETURN(std::vector<int32_t> cached, kv_->GetTokens(key));
    if (context.empty()) context = cached;
    for (int32_t t : context) {
      if (!tokenizer_->IsValid(t)) {
        return absl::InvalidArgumentError(
            absl::StrCat("session '", name.id, "': context token ", t, " outside the vocabulary"));
      }
    }
    if (cached.size() > context.size() || !std::equal(cached.begin(), cached.end(), context.begin())) {
      return absl::InvalidArgumentError(
          absl::StrCat("session '", name.id, "': cached tokens are not a prefix of its context"));
    }
    absl::MutexLock lock(&mu_);
    if (state.pinned) {
      KVCACHE_ASSIGN_OR_RETURN(kv::SessionInfo info, kv_->GetSession(key));
      // Pinning restores what the import staged in tier 1, which fails while
      // running or pinned sessions hold tier 0; a drain's move then goes on
      // unpinned, as over the quota.
      absl::Status pin = CheckPinQuota(name.tenant, key, info.tier0_pages + info.tier1_pages);
      if (pin.ok()) pin = kv_->PinSession(key);
      if (!pin.ok() && state.unpin_over_quota && absl::IsResourceExhausted(pin)) {
        KV_LOG_WARN("session '{}' moves in from a draining worker unpinned: {}", name.id,
                    std::string(pin.message()));
      } else if (!pin.ok()) {
        return pin;
      }
    }
    const int64_t last_reply =
        std::clamp<int64_t>(state.last_reply_tokens, 0, static_cast<int64_t>(context.size()));
    // An exporter that did not say (an older one): the reply alone.
    const int64_t last_request =
        std::clamp<int64_t>(state.last_request_tokens, last_reply, static_cast<int64_t>(context.size()));
    // The idle TTL counts from the last request, wherever it ran.
    const absl::Time now = absl::Now();
    const absl::Time last_used =
        state.last_used == absl::InfinitePast() ? now : std::min(state.last_used, now);
    SessionState held{name.tenant, std::move(context), last_used, last_reply, last_request};
    held.reply_open = state.reply_open.value_or(last_reply > 0 && !IsEndOfGeneration(held.context.back()));
    held.reply_open_before = state.reply_open_before.value_or(false);
    if (state.ended_early.has_value()) {
      held.ended_early = SessionDrop{
          std::clamp<int64_t>(state.ended_early->unread, 0, static_cast<int64_t>(held.context.size())),
          state.ended_early->reply_open};
    }
    held.last_request_id = state.last_request_id;
    AddSessionLocked(key, std::move(held));
    return absl::OkStatus();
  };
  if (absl::Status st = adopt(); !st.ok()) {
    (void)kv_->CloseSession(key);  // the pages came with the import: they go with it
    return st;
  }
  return name;
}

absl::StatusOr<std::unique_ptr<kv::SessionExporter>> Engine::BeginExport(const std::string& id,
                                                                         const std::string& tenant,
                                                                         kv::ExportOptions options) {
  const std::string key = kv::SessionKey(tenant, id);
  {
    absl::MutexLock lock(&mu_);
    KVCACHE_RETURN_IF_ERROR(CheckKnown(key, id));
    ++sessions_.find(key)->second.exports;
  }
  auto exporter = kv::SessionExporter::Create(kv_, key, options);
  if (!exporter.ok()) EndExport(id, tenant, /*handed_to=*/"");
  return exporter;
}

void Engine::EndExport(const std::string& id, const std::string& tenant, const std::string& handed_to) {
  const std::string key = kv::SessionKey(tenant, id);
  const bool handed_over = !handed_to.empty();
  if (handed_over) (void)kv_->CloseSession(key, nullptr, handed_to);  // the target holds it now
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(key);
  if (it == sessions_.end()) return;
  if (it->second.exports > 0) --it->second.exports;
  if (handed_over) EraseSessionLocked(key);
}

std::vector<kv::SessionName> Engine::Sessions() const {
  absl::MutexLock lock(&mu_);
  std::vector<kv::SessionName> out;
  out.reserve(sessions_.size());
  for (const auto& [key, state] : sessions_) {
    if (!kv::IsEphemeralKey(key)) out.push_back(kv::SplitSessionKey(key));
  }
  return out;
}

int Engine::ExpireIdleSessions(absl::Time now) {
  const absl::Duration ttl = options_.session_idle_ttl;
  if (ttl <= absl::ZeroDuration()) return 0;
  std::vector<std::string> idle;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [key, state] : sessions_) {
      if (now - state.last_used < ttl || state.exports > 0 || busy_.contains(key)) continue;
      // Pinned sessions never expire, and their last request's time stays
      // what GetSession says it is.
      if (auto info = kv_->GetSession(key); info.ok() && info->user_pinned) continue;
      idle.push_back(key);
      busy_.emplace(key, 0);  // nothing runs on it while it goes
    }
  }
  int expired = 0;
  for (const std::string& key : idle) {
    (void)kv_->CloseSession(key);  // busy: nothing could pin it since the check
    absl::MutexLock lock(&mu_);
    busy_.erase(key);
    EraseSessionLocked(key);
    ++expired;
  }
  if (expired > 0) {
    absl::MutexLock lock(&mu_);
    load_.sessions_expired += expired;
    KV_LOG_INFO("expired {} sessions idle for {}", expired, absl::FormatDuration(ttl));
  }
  return expired;
}

}  // namespace kvcache::sched
