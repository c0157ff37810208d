// The engine: continuous (iteration-level) batching of generation requests over
// the paged KV cache.
//
// One engine thread runs steps. Each step decodes one token for every running
// request that has finished its prompt, then spends the rest of the step on
// chunked prefill of the others, shortest remaining prompt first (a short turn
// is not queued behind a long cold prompt), aged by its tenant's prompt work done
// since each prompt arrived so that a long one is never starved (ties: oldest first),
// after the prompts of tenants that got fewer prompt tokens computed since they
// started waiting (fair across tenants): at most --max_batch_tokens tokens in all, and, while anything
// decodes, only as many prefill tokens as fit in the step-time target (max_step_time, predicted by a
// StepCostModel fitted to the engine's own step timings), so that a long prompt never stalls running streams
// for more than about one target; a prompt whose chunk ended inside a page goes on first to that page's end.
// Requests queued beyond max_running are admitted fairly across tenants (the tenant with the fewest running
// first, then the one admitted least recently; a tenant's own in arrival order), so that one tenant's backlog
// does not hold back another tenant's requests. Prefill chunks end on page boundaries; at each boundary a
// prefilling request picks up pages that are cached by then (AttachPrefix), and a request whose next page
// another request is computing in the same step waits for it instead of computing it again, so a burst of
// requests sharing a long system prompt computes it once. Before a
// step the KV cache's pressure policy runs inside BeginStep (offload idle
// sessions, restore this step's sessions, preempt others), so memory never
// exceeds the tier budgets. Cancellation and deadlines take effect at the next
// step boundary.
//
// Sessions: a request names a session (or none: an ephemeral session closed at
// the end). FULL_CONTEXT keeps the longest common prefix of the session's cached
// tokens and the input (or, for a new session, attaches the longest cached
// prefix of the same tenant) and prefills the rest. APPEND extends a live
// session. After a request the session holds its context and every generated
// token; the last sampled token has no K/V yet and is fed first by the next
// APPEND. A request that fails before its first token leaves the session as it
// was (a session it created is closed). Two requests on one session are never
// interleaved: the second is refused with ABORTED, unless the first was
// cancelled (it then waits for the first to end, a step away).
//
// Thread-safety: Submit, Cancel and the session calls are safe from any thread.
// Observers are called on the engine thread, never under an engine lock; they
// must not block for long and must not call back into the engine synchronously
// except Cancel.
#ifndef KVCACHE_WORKER_SCHED_ENGINE_H_
#define KVCACHE_WORKER_SCHED_ENGINE_H_

#include <algorithm>
#include <atomic>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/tokenizer/streaming_detokenizer.h"
#include "common/tokenizer/tokenizer.h"
#include "worker/kv/kv_cache_manager.h"
#include "worker/kv/kv_transfer.h"
#include "worker/kv/session_key.h"
#include "worker/model/model_runner.h"
#include "worker/model/sampler.h"
#include "worker/sched/step_cost_model.h"

namespace kvcache::sched {

// Per-tenant quotas (0 = unlimited). Over a quota a request or call gets
// RESOURCE_EXHAUSTED naming the tenant and the limit, before any token.
struct TenantLimits {
  int max_sessions = 0;          // named sessions held at once
  int64_t max_pinned_pages = 0;  // tier-0 pages of pinned sessions
  int max_requests = 0;          // requests queued or running at once
};

struct EngineOptions {
  int max_batch_tokens = 256;    // new tokens per step (decode + prefill chunks)
  int max_running = 64;          // requests in steps at once
  int max_waiting = 1024;        // queued beyond that: RESOURCE_EXHAUSTED, or another tenant's newest
                                 // request pushed out (Engine::PushOutCandidateLocked)
  int64_t max_context = 8192;    // tokens per session (clamped to the model's)
  int default_max_tokens = 256;  // when a request gives 0
  // Step-time target while requests decode (see above). Zero: automatic, 1.5
  // times the predicted time of the step's decodes alone; negative: none (the
  // token budget only, every prefill chunk as large as max_batch_tokens allows).
  absl::Duration max_step_time = absl::ZeroDuration();
  int max_tokens_per_request = 4096;
  // A named session no request has used for this long is closed (its pages freed,
  // routers told); pinned sessions and sessions being exported never expire.
  // Zero or less: never.
  absl::Duration session_idle_ttl = absl::Hours(4);
  TenantLimits tenant_limits;
};

enum class RequestMode { kFullContext, kAppend };

enum class FinishReason { kStop, kLength, kStopString, kContextFull };
const char* FinishReasonName(FinishReason r);

struct GenerateRequest {
  std::string session_id;  // empty: ephemeral (FULL_CONTEXT only)
  std::string tenant;
  RequestMode mode = RequestMode::kFullContext;
  std::vector<int32_t> input;
  model::SamplingConfig sampling;
  int max_tokens = 0;  // 0: EngineOptions::default_max_tokens
  std::vector<std::string> stop;
  std::vector<int32_t> stop_token_ids;
  bool ignore_eos = false;
  bool pin = false;
  absl::Time deadline = absl::InfiniteFuture();
  // APPEND: tokens of the session's last reply the client read; the rest of
  // that reply is dropped before the input is appended. -1: keep it all.
  int64_t tokens_read = -1;
  // APPEND of chat messages: the template's end-of-turn tokens
  // (ChatTemplate::EndOfTurn). They go before the input when the session's
  // context ends inside an assistant reply that stopped without them (cut by
  // max_tokens, a stop string or a cancel), as the template closes every
  // assistant turn: the conversation is then the one a FULL_CONTEXT request of
  // the same messages renders.
  std::vector<int32_t> close_turn;
  // This request's own output so far, streamed before by a request that was
  // cut (a router continuing the stream here). FULL_CONTEXT: the input's last
  // `continued` tokens (its first worker was lost or drained). APPEND, with an
  // empty input: the first `continued` tokens of the session's last reply,
  // which this request goes on (it ended out of room, or a drain cut it and
  // the session moved); the rest of that reply, if any, is dropped as
  // tokens_read drops it, and the session's last request is the cut one and
  // this one together (tokens_read = 0 after them drops both). They count
  // against max_tokens and in the session's last reply, the sampler draws
  // past them, and they prime the stop strings and the detokenizer: the
  // stream goes on as the uninterrupted one would. REQUIRES: 0 <= continued
  // <= input.size() (FULL_CONTEXT); input empty and tokens_read unset (APPEND).
  int64_t continued = 0;
  // The call's id (GenerateRequest.request_id): the session keeps the last
  // request's, and an APPEND that goes on a cut reply must name it.
  std::string request_id;
};

struct GenerateResult {
  FinishReason finish = FinishReason::kStop;
  std::string session_id;
  int64_t prompt_tokens = 0;    // context the model saw: cached + prefilled
  int64_t cached_tokens = 0;    // of prompt_tokens, served from cached pages
  int64_t restored_tokens = 0;  // of cached_tokens, restored from tier 1 first
  int64_t generated_tokens = 0;
  // K/V the cache dropped under memory pressure while the request ran (its pages
  // were preempted without tier-1 room), computed again from the context. Costs
  // time, never changes a token.
  int64_t recomputed_tokens = 0;
  absl::Duration queue_time;           // submit -> first step
  absl::Duration time_to_first_token;  // submit -> first token
  absl::Duration total_time;           // submit -> done
  std::vector<int32_t> output;         // generated ids
};

class GenerateObserver {
 public:
  virtual ~GenerateObserver() = default;
  // One generated token and the UTF-8 text it completed (may be empty).
  virtual void OnToken(int32_t id, absl::string_view text) = 0;
  // Exactly once, last. `status` is OK, CANCELLED, DEADLINE_EXCEEDED,
  // RESOURCE_EXHAUSTED (could not make progress) or INTERNAL.
  virtual void OnDone(const absl::Status& status, const GenerateResult& result) = 0;
};

// What one step did, for metrics.
struct StepStats {
  int sequences = 0;
  int decode_tokens = 0;
  int prefill_tokens = 0;
  absl::Duration duration;
  // Of which the runner's forward pass, and of that the linear layers' products
  // and attention (ModelRunner::last_forward_profile; zero where the runner does
  // not time them apart).
  absl::Duration forward;
  absl::Duration products;
  absl::Duration attention;
  int64_t recomputed_tokens = 0;  // tokens the cache had lost, put back in this step's plan
  // Prompt tokens that prefilling requests found cached at a chunk boundary
  // (computed meanwhile by a request sharing their prefix), so not computed again.
  int64_t joined_tokens = 0;
};

// Load, for Watch reports and admission decisions.
struct EngineLoad {
  int running = 0;
  int waiting = 0;
  int64_t queued_prefill_tokens = 0;
  double decode_tokens_per_second = 0;  // over the last second of steps
  // Prompt tokens per second of prefill over recent steps with prefill (the last
  // 10 s of them; the last value is kept while no prefill runs). 0 until then.
  double prefill_tokens_per_second = 0;
  int64_t sessions_expired = 0;  // since start, by session_idle_ttl
};

// Tokens an APPEND drops from the end of its session's conversation before its
// input (GenerateRequest::tokens_read), and whether what is left ends inside a
// reply that stopped without its end of turn (GenerateRequest::close_turn).
struct SessionDrop {
  int64_t unread = 0;
  bool reply_open = false;
};

// The engine's view of one named session.
struct SessionView {
  int64_t context_tokens = 0;       // see Engine::Context
  int64_t last_reply_tokens = 0;    // of those, what the last request generated (the last ones)
  int64_t last_request_tokens = 0;  // of those, what the last request added (input and reply)
  absl::Time last_used;             // submit or end of the last request (or its import or fork)
  // The context ends inside a reply that stopped without its end of turn; and
  // so it did before the last request (SessionChunk.Commit.reply_open).
  bool reply_open = false;
  bool reply_open_before = false;
  // The last request ended before its first token: what it dropped, which the
  // next APPEND drops too unless it says otherwise (SessionChunk.Commit.ended_early_unread).
  std::optional<SessionDrop> ended_early;
  std::string last_request_id;  // the last request's GenerateRequest::request_id
  bool exporting = false;       // an export or migration is running
  bool busy = false;            // a request (or a session call) holds it
};

// What an exporter knew of a session beyond its pages (SessionChunk.Commit),
// for Engine::FinishImport.
struct ImportedState {
  bool pinned = false;              // the exporter's pin
  int64_t last_reply_tokens = 0;    // the context's last tokens that its last request generated
  int64_t last_request_tokens = 0;  // the context's last tokens that its last request added
  // Its last request there; InfinitePast, or a time ahead of this clock: now.
  absl::Time last_used = absl::InfinitePast();
  // SessionView's flags there; unknown (an older exporter): reply_open from
  // the last reply and the context's last token, reply_open_before false.
  std::optional<bool> reply_open;
  std::optional<bool> reply_open_before;
  std::optional<SessionDrop> ended_early;  // SessionView's
  std::string last_request_id;             // SessionView's
  // Over the tenant's pinned-pages quota here, import it unpinned (a drain's
  // move) instead of refusing it.
  bool unpin_over_quota = false;
};

class Engine {
 public:
  // Starts the engine thread. `runner`, `kv` and `tokenizer` must outlive it.
  static absl::StatusOr<std::unique_ptr<Engine>> Create(EngineOptions options, model::ModelRunner* runner,
                                                        kv::KvCacheManager* kv,
                                                        const tok::Tokenizer* tokenizer);
  ~Engine();  // Stop()
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Validates and queues a request; its observer then receives tokens and
  // exactly one OnDone. Errors here mean no observer call at all:
  // INVALID_ARGUMENT (empty input, token out of vocabulary, context over the
  // limit, bad sampling or max_tokens), NOT_FOUND (APPEND to an unknown session
  // or another tenant's, also one that a session call being waited for moved
  // away or closed), ABORTED (a request is running on the session; one that was
  // cancelled, or is cancelled within kCancelGrace, is waited for, up to
  // kCancelledRequestWait; an APPEND with tokens_read set follows a cancel, and
  // waits up to kCancelledRequestWait for it; or a session call held it for
  // kSessionCallWait),
  // RESOURCE_EXHAUSTED (queue full, or the prompt can never fit in tier 0),
  // UNAVAILABLE (stopping). Returns a request id for Cancel.
  absl::StatusOr<uint64_t> Submit(GenerateRequest request, GenerateObserver* observer);
  // Cancels a request (no-op when already done). Its OnDone reports CANCELLED, at
  // the next step boundary, also while it is still queued; the token of a step
  // that was running meanwhile is neither sent nor kept in the session.
  void Cancel(uint64_t request_id);
  // Ends every queued and running request with `status` at the next step
  // boundary, as Cancel does (a running one keeps the tokens it has sent), and
  // keeps the engine running: a drain cuts its streams this way so that their
  // sessions can move. Returns how many requests it cut.
  int CutRequests(const absl::Status& status);
  // Request ids the engine still tracks (live or cancelled, not finished); 0 when
  // idle. For leak tests.
  size_t tracked_request_ids() const;

  // Session calls. Sessions are named by (tenant, id): the same id in two tenants
  // names two sessions, and an unknown id is NOT_FOUND whoever holds it elsewhere.
  // ABORTED while a request runs on the session (one that was cancelled, or is
  // cancelled within kCancelGrace, is waited for, as Submit does), or when
  // another session call holds it for kSessionCallWait.
  // CloseSession: `pages_freed` (optional) gets the pages released for good.
  absl::Status CloseSession(const std::string& id, const std::string& tenant, int64_t* pages_freed = nullptr);
  // ForkSession: ALREADY_EXISTS when `new_id` is taken, RESOURCE_EXHAUSTED over
  // the tenant's session quota (the new session counts like a created one).
  absl::Status ForkSession(const std::string& id, const std::string& new_id, const std::string& tenant);
  absl::Status SetPinned(const std::string& id, const std::string& tenant, bool pinned);
  absl::Status Offload(const std::string& id, const std::string& tenant);
  absl::Status Restore(const std::string& id, const std::string& tenant);
  // Marks the session busy (as a request would) so nothing else runs on it, e.g.
  // while it is exported. ABORTED when busy (a cancelled request and another
  // session call are waited for, as Submit does); NOT_FOUND when unknown.
  absl::Status Reserve(const std::string& id, const std::string& tenant);
  // Like Reserve, but waits up to `timeout` for a running request to finish.
  absl::Status ReserveWait(const std::string& id, const std::string& tenant, absl::Duration timeout);
  void Release(const std::string& id, const std::string& tenant);
  // The session's whole context as the engine knows it: every token of its
  // conversation, including the last sampled one (which has no K/V yet) and any
  // the KV cache dropped under pressure (they are recomputed on the next
  // request). NOT_FOUND when unknown. Migration carries it.
  absl::StatusOr<std::vector<int32_t>> Context(const std::string& id, const std::string& tenant) const;
  absl::StatusOr<SessionView> View(const std::string& id, const std::string& tenant) const;
  // Import: BeginImport returns an importer that stages a session's pages in
  // the KV cache; feed it the chunks, and once it has committed, FinishImport
  // makes the session this engine's with `context` (the tokens it continues
  // from; empty: the cached tokens) and what `state` says of it.
  // INVALID_ARGUMENT when the cached tokens are not a prefix of `context` or a
  // token is outside the vocabulary, RESOURCE_EXHAUSTED when the pin would pass
  // the tenant's pinned-pages quota; on any
  // failure the imported pages are released and no session remains. Dropping an
  // importer that never committed leaves no trace either.
  absl::StatusOr<std::unique_ptr<kv::SessionImporter>> BeginImport();
  // Before the commit chunk: RESOURCE_EXHAUSTED when `state` asks for a pin
  // (and does not allow the import unpinned) that the importer's staged pages
  // would take past the tenant's quota, or whose restore could not bring its
  // tier-1 pages into tier 0 now, so that such an import is refused before the
  // session appears here at all (FinishImport pins it, and may still fail:
  // another session may pin or start meanwhile).
  absl::Status CheckImportPin(const kv::SessionImporter& importer, const ImportedState& state) const;
  // REQUIRES: importer.committed(). Returns the session's name.
  absl::StatusOr<kv::SessionName> FinishImport(const kv::SessionImporter& importer,
                                               std::vector<int32_t> context, const ImportedState& state = {});
  // Export: BeginExport marks the session exporting (reported as migrating; it
  // never expires meanwhile) and returns an exporter over its pages. EndExport
  // ends that; a non-empty `handed_to` names the worker that holds the session
  // now (in the close's kSessionMigrated event), and it is closed here; empty:
  // the export failed or was a copy, and the session stays.
  // REQUIRES for handed_to: the caller holds it (Reserve).
  absl::StatusOr<std::unique_ptr<kv::SessionExporter>> BeginExport(const std::string& id,
                                                                   const std::string& tenant,
                                                                   kv::ExportOptions options);
  void EndExport(const std::string& id, const std::string& tenant, const std::string& handed_to);
  // Every named session (tenant, id), in no particular order.
  std::vector<kv::SessionName> Sessions() const;
  // Closes named sessions idle for session_idle_ttl (the engine thread calls it
  // between steps). Returns how many.
  int ExpireIdleSessions(absl::Time now);

  EngineLoad Load() const;
  // Called after every step on the engine thread (metrics).
  void SetStepCallback(std::function<void(const StepStats&)> callback);

  // Fails every queued and running request with UNAVAILABLE and joins the thread.
  void Stop();
  // Waits until no request is queued or running, or `timeout` passes.
  bool WaitIdle(absl::Duration timeout);
  // Waits until the engine holds no session (they were closed or migrated away),
  // or `timeout` passes. Returns whether none is left.
  bool WaitNoSessions(absl::Duration timeout);

  const EngineOptions& options() const { return options_; }

 private:
  struct Request;

  Engine(EngineOptions options, model::ModelRunner* runner, kv::KvCacheManager* kv,
         const tok::Tokenizer* tokenizer);
  void Loop();
  // Sets up the request's KV session (engine thread). Returns false when done.
  bool Prepare(Request& r);
  // Whether a queued request leaves at the engine thread's next turn (cancelled,
  // pushed out, or past its deadline).
  bool LeavingLocked(const Request& r, absl::Time now) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The tenant holds --tenant_max_requests requests that are not leaving.
  bool OverRequestLimitLocked(const std::string& tenant) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Queued requests that are not leaving: what --max_waiting bounds.
  int QueuedLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // With the queue full, a request of `tenant` pushes out the newest queued
  // request of the tenant holding the most of the queue, if that tenant holds at
  // least two more than `tenant` (so one tenant's flood cannot lock the others
  // out of the queue; a lone tenant is refused as before). Its id and tenant.
  std::optional<std::pair<uint64_t, std::string>> PushOutCandidateLocked(const std::string& tenant) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Moves waiting requests to `admitted` while active_ and `admitted` hold fewer
  // than max_running, fairly across tenants: each slot goes to the tenant with the
  // fewest requests running, then to the one admitted least recently, so that one
  // tenant's backlog does not queue another's requests behind it; a tenant's own
  // requests keep their arrival order.
  void AdmitFairlyLocked(std::vector<std::unique_ptr<Request>>& admitted) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Brings prefill_served_ to the tenants with a prompt to compute in active_,
  // and tenant_prefilled_ to the tenants with requests there.
  void TrackTenantPrefill();
  // Runs one step over active_. Returns false when nothing could run.
  bool Step();
  // At a page boundary of a prefill that has not sampled yet, attaches the pages
  // of its prompt that are cached by now. Returns the tokens attached.
  int64_t JoinCachedPrefix(Request& r);
  // Whether the next page of `r`'s prefill is one that a request planned in this
  // step (`planned`) is computing or will compute: same tenant, same tokens up to
  // the end of that page, not further along than `r`.
  bool AwaitsSharedPrefill(const Request& r, const std::vector<const Request*>& planned) const;
  // True when the sampled token's K/V would need more tier-0 pages than the tier
  // has (the request can never step again on this worker).
  bool OutgrowsTier0(const Request& r) const;
  // One of the vocabulary's end-of-generation tokens (EOS, EOT, <|im_end|>, ...).
  bool IsEndOfGeneration(int32_t token) const {
    const std::vector<int32_t>& eog = tokenizer_->eog_ids();
    return std::find(eog.begin(), eog.end(), token) != eog.end();
  }
  // BeginStep for up to `budget` of the request's pending tokens, after checking
  // that the cache still holds every token the engine expects it to; what it lost
  // is queued for recompute first.
  absl::StatusOr<kv::StepReservation> Reserve(Request& r, int budget);
  // Re-derives the request's pending tokens from what the cache holds (`held`
  // tokens, a prefix of its context).
  absl::Status Resync(Request& r, int64_t held);
  void Finish(Request& r, absl::Status status, std::optional<FinishReason> reason);
  // NOT_FOUND naming `id` unless `key` is a known session.
  absl::Status CheckKnown(const std::string& key, const std::string& id) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // RESOURCE_EXHAUSTED when one more named session for `tenant` (a request that
  // creates one, or a fork) would pass --tenant_max_sessions; sessions that
  // queued requests will create count.
  absl::Status CheckSessionQuota(const std::string& tenant) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // RESOURCE_EXHAUSTED when `tenant`'s pinned pages, with session `key`
  // holding `pages` (pinned), would pass its quota.
  absl::Status CheckPinQuota(const std::string& tenant, const std::string& key, int64_t pages) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const EngineOptions options_;
  model::ModelRunner* const runner_;
  kv::KvCacheManager* const kv_;
  const tok::Tokenizer* const tokenizer_;
  const int page_tokens_;

  mutable absl::Mutex mu_;
  absl::CondVar wake_;
  std::deque<std::unique_ptr<Request>> waiting_ ABSL_GUARDED_BY(mu_);
  // Sessions by kv::SessionKey(tenant, id), the KV cache's key too. busy_: the
  // sessions something holds -> the request running on it (0: a session call,
  // an export or an expiry holds it).
  absl::flat_hash_map<std::string, uint64_t> busy_ ABSL_GUARDED_BY(mu_);
  // A request or session call on a session that something holds.
  // - A session call (close, fork, pin, offload, restore, an export, a
  //   migration's pause): waits up to kSessionCallWait for it to end, so that a
  //   client's next turn during a migration's pause runs after it, or finds the
  //   session gone (NOT_FOUND, which a router follows to the new worker), instead
  //   of failing. Returns false; the caller checks busy_ again.
  // - A request: a client that cancelled it may send its next call at once, and
  //   the cancel can reach this worker after the call (they travel separately).
  //   Waits up to `cancel_grace` for the cancel (kCancelGrace; a request that
  //   says it follows a cancel, kCancelledRequestWait), then up to
  //   kCancelledRequestWait for the cancelled request to end (the next step
  //   boundary). True when the request was not cancelled in the grace: the
  //   call arrived while it ran, ABORTED (also if it has ended meanwhile, so
  //   that the answer depends on the order of arrival alone).
  bool AwaitHolderLocked(const std::string& key, absl::Duration cancel_grace)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // What holds a busy session, for ABORTED messages.
  const char* BusyWithLocked(const std::string& key) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static constexpr absl::Duration kCancelGrace = absl::Milliseconds(100);
  static constexpr absl::Duration kCancelledRequestWait = absl::Seconds(2);
  static constexpr absl::Duration kSessionCallWait = absl::Seconds(2);
  struct SessionState {
    std::string tenant;
    std::vector<int32_t> context;  // see Context()
    absl::Time last_used;
    int64_t last_reply = 0;  // tokens at the end of context that the last request generated
    // Tokens at the end of context that the last request added: an APPEND's
    // input and its reply (a FULL_CONTEXT request's reply). 0 after a request
    // that left the session as it was. tokens_read = 0 drops them all.
    int64_t last_request = 0;
    int exports = 0;
    // The context ends inside an assistant reply that stopped without an
    // end-of-generation token (GenerateRequest::close_turn); and so it did
    // before the last request (for tokens_read = 0).
    bool reply_open = false;
    bool reply_open_before = false;
    // Set while the last request is one that ended before its first token (in
    // the queue, or failing), which left everything above as it was: what that
    // request dropped (its Drop), which stands for the next one (see DropFor).
    std::optional<SessionDrop> ended_early = std::nullopt;
    // GenerateRequest::request_id of the last request that changed the session
    // (not one that ended before its first token): what an APPEND going on
    // its cut reply must name.
    std::string last_request_id = std::string();
  };
  void AddSessionLocked(const std::string& key, SessionState state) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // What an APPEND request drops from the end of `held`'s context before its
  // input, and whether the context then ends inside an open reply (so the
  // request closes that turn first). tokens_read (GenerateRequest) drops the
  // last reply's unread tokens, or with 0 the whole last request, its input
  // too: a client that read nothing of a reply cannot know whether its request
  // reached the session (it may have been cut in the queue, or after tokens
  // that were still on their way), and resends or replaces its message, so the
  // conversation it saw ends before that request. After a request that ended
  // before its first token (ended_early), tokens_read unset or 0 drops what
  // that request dropped (it has no tokens of its own), and a positive one
  // counts against the reply before it, as that request's did: the next
  // request, or a retry of that one, sees the conversation whether or not the
  // ended one had reached the session. FULL_CONTEXT drops nothing.
  static SessionDrop DropFor(const GenerateRequest& request, const SessionState& held) {
    if (request.mode != RequestMode::kAppend) return SessionDrop{0, held.reply_open};
    if (held.ended_early.has_value() && request.tokens_read <= 0) return *held.ended_early;
    if (request.tokens_read < 0) return SessionDrop{0, held.reply_open};
    const int64_t unread = request.tokens_read == 0 ? std::max(held.last_request, held.last_reply)
                                                    : held.last_reply - request.tokens_read;
    SessionDrop drop;
    drop.unread = std::clamp<int64_t>(unread, 0, static_cast<int64_t>(held.context.size()));
    // tokens_read = 0 goes back to before the last request; another value keeps
    // part of the last reply, cut short.
    drop.reply_open = request.tokens_read == 0 ? held.reply_open_before : drop.unread > 0 || held.reply_open;
    return drop;
  }
  void EraseSessionLocked(const std::string& key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::flat_hash_map<std::string, SessionState> sessions_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, int> tenant_sessions_ ABSL_GUARDED_BY(mu_);  // tenant -> sessions_
  struct Live {
    absl::Time deadline;
    std::string tenant;
  };
  absl::flat_hash_map<uint64_t, Live> live_ ABSL_GUARDED_BY(mu_);  // submitted, not finished
  // Live requests to end at the next step boundary, with their status.
  absl::flat_hash_map<uint64_t, absl::Status> cancelled_ ABSL_GUARDED_BY(mu_);
  // Calls waiting in AwaitHolderLocked, and the requests that ended cancelled
  // meanwhile (cleared when none waits).
  int holder_waiters_ ABSL_GUARDED_BY(mu_) = 0;
  // Tenants with a Submit waiting for a late cancel at their request limit.
  absl::flat_hash_set<std::string> limit_waiters_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<uint64_t> ended_cancelled_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, int> inflight_ ABSL_GUARDED_BY(mu_);  // tenant -> requests
  // Tenants with requests queued or running -> when one of theirs was last
  // admitted (in admissions_), for AdmitFairlyLocked.
  absl::flat_hash_map<std::string, int64_t> last_admitted_ ABSL_GUARDED_BY(mu_);
  int64_t admissions_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_request_id_ ABSL_GUARDED_BY(mu_) = 1;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  EngineLoad load_ ABSL_GUARDED_BY(mu_);
  std::function<void(const StepStats&)> step_callback_ ABSL_GUARDED_BY(mu_);

  // Engine thread only.
  std::vector<std::unique_ptr<Request>> active_;
  // Tenants with requests in active_ -> prompt tokens computed for them since
  // (ages their waiting prompts: Request::admitted_at_prefill).
  absl::flat_hash_map<std::string, int64_t> tenant_prefilled_;
  // Tenants with a prompt to compute -> prompt tokens computed for them since they
  // started waiting, which a tenant joining starts at the least of the others'.
  // The least served tenant's prompts go first (fair queuing across tenants).
  absl::flat_hash_map<std::string, int64_t> prefill_served_;
  std::deque<std::pair<absl::Time, int>> recent_decode_;  // (step end, tokens)
  struct PrefillStep {
    absl::Time end;
    int tokens;
    absl::Duration took;
  };
  std::deque<PrefillStep> recent_prefill_;  // steps with prefill, the last 10 s
  int64_t recent_prefill_tokens_ = 0;       // their sums
  absl::Duration recent_prefill_time_;
  StepCostModel step_cost_;
  absl::Time last_cost_log_ = absl::InfinitePast();
  uint64_t ephemeral_counter_ = 0;
  absl::Time next_expiry_ = absl::InfinitePast();

  std::thread thread_;
};

}  // namespace kvcache::sched

#endif  // KVCACHE_WORKER_SCHED_ENGINE_H_
