// kvcache-worker: serves one model on one backend and keeps every session's KV
// cache in pages (tier 0: backend memory, tier 1: host RAM).
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/internal/parse.h"
#include "absl/strings/str_cat.h"
#include "common/gguf/model_path.h"
#include "common/init.h"
#include "common/logging.h"
#include "common/memory_limit.h"
#include "common/peer_auth.h"
#include "common/server.h"
#include "common/status_macros.h"
#include "common/tokenizer/chat_template.h"
#include "common/tokenizer/tokenizer.h"
#include "worker/backend/backend.h"
#include "worker/backend/cpu/cpu_features.h"
#include "worker/kv/kv_cache_manager.h"
#include "worker/model/llama_model.h"
#include "worker/sched/engine.h"
#include "worker/service/watch_hub.h"
#include "worker/service/worker_metrics.h"
#include "worker/service/worker_service.h"

ABSL_FLAG(std::string, model, "",
          "GGUF model file (default: $KVCACHE_MODEL or the one scripts/setup.sh fetches)");
ABSL_FLAG(std::string, worker_id, "",
          "Name of this worker in routing, logs and metrics (default: --listen's host, or this machine's "
          "hostname when that is a wildcard, then ':' and the port, or '-pid<pid>' for port 0)");
ABSL_FLAG(
    std::string, device, "cpu",
    "Backend: cpu, or cuda[:N] (the CUDA plugin on GPU N; tier 0 in device memory, tier 1 pinned host)");
ABSL_FLAG(std::string, cuda_plugin, "",
          "libkvcache_cuda.so to load for --device=cuda (default: beside this binary, then "
          "$KVCACHE_BUILD_DIR/worker)");
ABSL_FLAG(bool, cuda_graphs, true,
          "--device=cuda: replay steps of up to 128 new tokens (every decode step) from CUDA graphs "
          "captured once per padded width; false launches every kernel of every step");
ABSL_FLAG(int64_t, tier0_bytes, int64_t{1} << 30, "KV budget in backend memory (tier 0), bytes");
ABSL_FLAG(
    int64_t, memory_limit_bytes, 0,
    "Host memory this worker may use, checked at start against the KV tiers in host memory, the model and "
    "the process (0: the container's cgroup limit, if any; negative: no check)");
ABSL_FLAG(int64_t, tier1_bytes, int64_t{4} << 30,
          "KV budget in host RAM for offloaded pages (tier 1), bytes; 0 disables");
ABSL_FLAG(int32_t, page_tokens, 16, "Tokens per KV page");
ABSL_FLAG(std::string, kv_dtype, "f16", "KV element type: f16, bf16 or f32");
ABSL_FLAG(int32_t, threads, 0, "Compute threads (0: all cores)");
ABSL_FLAG(std::string, cpu_kernel_level, "",
          "CPU backend kernels: auto (the best this CPU supports), avx512, avx2 or scalar (default: "
          "$KVCACHE_CPU_KERNEL_LEVEL, else auto)");
ABSL_FLAG(int32_t, max_batch_tokens, 256, "New tokens per engine step (decode + chunked prefill)");
ABSL_FLAG(double, max_step_ms, 0,
          "Step-time target while requests decode: prefill chunks are sized (from the engine's own step "
          "timings) so that a step takes about this long, bounding inter-token latency. 0: automatic (1.5 "
          "times the time of the step's decodes alone); negative: none (max_batch_tokens only)");
ABSL_FLAG(int64_t, max_context, 8192, "Tokens per session (clamped to the model's context)");
ABSL_FLAG(int32_t, max_running, 64, "Requests in engine steps at once");
ABSL_FLAG(int32_t, max_waiting, 1024, "Queued requests before RESOURCE_EXHAUSTED");
ABSL_FLAG(int32_t, default_max_tokens, 256, "max_tokens of a request that gives 0");
ABSL_FLAG(int32_t, max_tokens_per_request, 4096, "Largest max_tokens a request may ask for");
ABSL_FLAG(int32_t, tenant_max_sessions, 0,
          "Named sessions one tenant may open here (0: unlimited); sessions migrated here count, and are "
          "never refused for it");
ABSL_FLAG(int64_t, tenant_max_pinned_pages, 0, "KV pages one tenant may keep pinned (0: unlimited)");
ABSL_FLAG(int32_t, tenant_max_requests, 0, "Requests one tenant may have queued or running (0: unlimited)");
ABSL_FLAG(absl::Duration, session_idle_ttl, absl::Hours(4),
          "Named sessions unused this long are closed (pinned ones excepted; 0: never)");
ABSL_FLAG(int32_t, watch_snapshot_part, 4096,
          "Sessions and block hashes per Watch snapshot message (larger snapshots come in parts)");
ABSL_FLAG(absl::Duration, load_report_interval, absl::Seconds(1), "Watch load report period");
ABSL_FLAG(absl::Duration, drain_deadline, absl::Seconds(30),
          "How long a drain (admin Drain, or SIGTERM: at most two thirds of --shutdown_deadline) lets "
          "running streams finish before their sessions move");

namespace kvcache {
namespace {

constexpr char kName[] = "kvcache-worker";
// --cpu_kernel_level's default: one variable sets the level of every worker of a
// pod or a test run (CI runs part of the suite at avx2 this way).
constexpr char kCpuKernelLevelEnv[] = "KVCACHE_CPU_KERNEL_LEVEL";

// --worker_id's default: unique among the workers of a fleet and of one
// machine. A wildcard host (0.0.0.0, [::], empty) names no machine, and port 0
// is chosen at bind time, after the id is needed.
std::string DefaultWorkerId(const std::string& listen) {
  const size_t colon = listen.rfind(':');
  std::string host = colon == std::string::npos ? listen : listen.substr(0, colon);
  const std::string port = colon == std::string::npos ? "" : listen.substr(colon + 1);
  if (host.empty() || host == "0.0.0.0" || host == "[::]" || host == "::" || host == "*") {
    char name[256] = {};
    host = gethostname(name, sizeof(name) - 1) == 0 && name[0] != '\0' ? name : "worker";
  }
  if (port.empty() || port == "0") return absl::StrCat(host, "-pid", getpid());
  return absl::StrCat(host, ":", port);
}

// Who may call this worker (see common/peer_auth.h): holders of the cluster
// token, peers with a client certificate the TLS handshake verified, or, only
// when asked for explicitly, anyone.
absl::StatusOr<ClusterToken> PeerAuthFromOptions(const ServerOptions& options) {
  ClusterToken token;
  if (!options.cluster_token_file.empty()) {
    KVCACHE_ASSIGN_OR_RETURN(token, ClusterToken::FromFile(options.cluster_token_file));
    KV_LOG_INFO("peers authenticate with the cluster token of {}", options.cluster_token_file);
  }
  if (!options.tls_client_ca_file.empty()) {
    KV_LOG_INFO("peers authenticate with client certificates signed by {}", options.tls_client_ca_file);
  } else if (token.empty()) {
    if (!options.allow_unauthenticated) {
      return absl::FailedPreconditionError(
          "a worker takes internal calls only from authenticated peers: give --cluster_token_file (the "
          "fleet's shared token) or --tls_cert, --tls_key and --tls_client_ca (mutual TLS); "
          "--allow_unauthenticated serves anyone who reaches the port");
    }
    KV_LOG_WARN(
        "--allow_unauthenticated: anyone who reaches this port can read, export and migrate every "
        "tenant's sessions; use --cluster_token_file or mutual TLS outside a trusted machine");
  }
  return token;
}

// --cpu_kernel_level, else $KVCACHE_CPU_KERNEL_LEVEL, else auto; INVALID_ARGUMENT
// (naming where the value came from) for a name this CPU cannot run.
absl::StatusOr<cpu::CpuKernelLevel> CpuKernelLevelFromFlags() {
  std::string name = absl::GetFlag(FLAGS_cpu_kernel_level);
  std::string source = "--cpu_kernel_level";
  if (name.empty()) {
    const char* env = std::getenv(kCpuKernelLevelEnv);
    name = env != nullptr && *env != '\0' ? env : "auto";
    source = absl::StrCat("$", kCpuKernelLevelEnv);
  }
  absl::StatusOr<cpu::CpuKernelLevel> level = cpu::ParseCpuKernelLevel(name);
  if (!level.ok()) return absl::InvalidArgumentError(absl::StrCat(source, ": ", level.status().message()));
  return level;
}

absl::Status CheckFlags() {
  if (absl::Status st = backend::ParseDevice(absl::GetFlag(FLAGS_device)).status(); !st.ok()) return st;
  if (absl::Status st = CpuKernelLevelFromFlags().status(); !st.ok()) return st;
  KVCACHE_RETURN_IF_ERROR(kv::ValidateBudgetFlags(
      absl::GetFlag(FLAGS_tier0_bytes), absl::GetFlag(FLAGS_tier1_bytes), absl::GetFlag(FLAGS_page_tokens)));
  if (absl::GetFlag(FLAGS_threads) < 0) return absl::InvalidArgumentError("--threads must not be negative");
  if (absl::GetFlag(FLAGS_max_batch_tokens) < 1 || absl::GetFlag(FLAGS_max_batch_tokens) > 8192) {
    return absl::InvalidArgumentError("--max_batch_tokens must be in [1, 8192]");
  }
  if (absl::GetFlag(FLAGS_max_context) < 2)
    return absl::InvalidArgumentError("--max_context must be at least 2");
  for (const auto& [name, value] :
       {std::pair<const char*, int32_t>{"max_running", absl::GetFlag(FLAGS_max_running)},
        {"default_max_tokens", absl::GetFlag(FLAGS_default_max_tokens)},
        {"max_tokens_per_request", absl::GetFlag(FLAGS_max_tokens_per_request)}}) {
    if (value < 1)
      return absl::InvalidArgumentError(absl::StrCat("--", name, "=", value, ": must be positive"));
  }
  if (absl::GetFlag(FLAGS_max_waiting) < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_waiting=", absl::GetFlag(FLAGS_max_waiting), ": must not be negative"));
  }
  if (absl::GetFlag(FLAGS_tenant_max_sessions) < 0 || absl::GetFlag(FLAGS_tenant_max_pinned_pages) < 0 ||
      absl::GetFlag(FLAGS_tenant_max_requests) < 0) {
    return absl::InvalidArgumentError("--tenant_max_* must not be negative (0: unlimited)");
  }
  if (absl::GetFlag(FLAGS_load_report_interval) <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--load_report_interval must be positive");
  }
  return kv::ParseDtype(absl::GetFlag(FLAGS_kv_dtype)).status();
}

// Tier 0 that defaults shrink to at most, to fit a memory limit.
constexpr int64_t kMinDefaultTier0Bytes = int64_t{64} << 20;

struct TierBudgets {
  int64_t tier0 = 0;
  int64_t tier1 = 0;
};

// Whether --`name` was given (on the command line or in a --flagfile), at its
// default value too: a budget given is the operator's, to be refused rather
// than shrunk. Abseil 20220623 says so only through flags_internal
// (CommandLineFlag::IsSpecifiedOnCommandLine is private there).
bool Given(absl::string_view name) { return absl::flags_internal::WasPresentOnCommandLine(name); }

// The KV budgets against the host memory the worker may use (tier 1, tier 0 on
// the CPU backend, one copy of the weights, kWorkerProcessBytes): the
// container's cgroup limit or --memory_limit_bytes. Budgets left at their
// defaults shrink to fit (tier 1 first, then tier 0 down to
// kMinDefaultTier0Bytes), with a warning; budgets given that do not fit are
// INVALID_ARGUMENT, so that the mistake stops the worker at start, not the OOM
// killer at peak load, where every session would be lost. Above the machine's
// RAM with no limit it only warns: the tiers are committed as they fill.
absl::StatusOr<TierBudgets> FitMemoryLimit(const backend::DeviceSpec& device, const std::string& model_path) {
  TierBudgets b{absl::GetFlag(FLAGS_tier0_bytes), absl::GetFlag(FLAGS_tier1_bytes)};
  std::error_code error;
  const auto file_bytes = static_cast<int64_t>(std::filesystem::file_size(model_path, error));
  const int64_t weights = error ? 0 : file_bytes;
  const bool host_tier0 = device.kind == backend::DeviceSpec::Kind::kCpu;
  auto need = [&] { return WorkerHostBytes(host_tier0 ? b.tier0 : 0, b.tier1, weights); };
  auto what = [&] {
    return absl::StrCat(
        host_tier0 ? absl::StrCat("--tier0_bytes=", b.tier0, " (tier 0 is host memory on the CPU) + ") : "",
        "--tier1_bytes=", b.tier1, " + the model's ", weights, " bytes + about ", kWorkerProcessBytes >> 20,
        " MiB for the process = ", need(), " bytes");
  };
  const int64_t flag = absl::GetFlag(FLAGS_memory_limit_bytes);
  if (flag < 0) return b;
  std::optional<CgroupLimit> limit =
      flag > 0 ? std::optional<CgroupLimit>(CgroupLimit{flag, "--memory_limit_bytes"}) : ProcessMemoryLimit();
  if (!limit) {
    if (std::optional<int64_t> ram = PhysicalMemoryBytes(); ram && need() > *ram) {
      KV_LOG_WARN("{}, above this machine's {} bytes of RAM: the tiers will not fill before memory runs out",
                  what(), *ram);
    }
    return b;
  }
  if (need() <= limit->bytes) return b;
  const TierBudgets asked = b;
  int64_t over = need() - limit->bytes;
  if (!Given("tier1_bytes")) {
    const int64_t cut = std::min(over, b.tier1);
    b.tier1 -= cut;
    over -= cut;
  }
  if (over > 0 && host_tier0 && !Given("tier0_bytes") && b.tier0 > kMinDefaultTier0Bytes) {
    const int64_t cut = std::min(over, b.tier0 - kMinDefaultTier0Bytes);
    b.tier0 -= cut;
    over -= cut;
  }
  if (over > 0) {
    b = asked;
    return absl::InvalidArgumentError(
        absl::StrCat(what(), ", above this worker's memory limit of ", limit->bytes, " bytes (", limit->file,
                     "): lower --tier1_bytes or --tier0_bytes, or raise the limit (budgets left at their "
                     "defaults shrink to fit; budgets given do not)"));
  }
  auto budget = [](const char* flag, int64_t now, int64_t was, bool by_default) {
    return absl::StrCat(flag, "=", now,
                        now != was ? absl::StrCat(" (its default ", was, ", shrunk)")
                                   : (by_default ? " (its default)" : " (as given)"));
  };
  KV_LOG_WARN("default KV budgets shrunk to fit this worker's memory limit of {} bytes ({}): {}, {}; {}",
              limit->bytes, limit->file, budget("--tier0_bytes", b.tier0, asked.tier0, !Given("tier0_bytes")),
              budget("--tier1_bytes", b.tier1, asked.tier1, !Given("tier1_bytes")), what());
  return b;
}

int Run() {
  auto options = ServerOptionsFromFlags(kName);
  if (!options.ok()) DieWith(kName, options.status());
  // Its shutdown hook returns once the streams are done and the sessions have
  // left (or the deadline is near): what is left are stragglers.
  options->stop_grace = absl::Seconds(1);
  if (absl::Status st = CheckFlags(); !st.ok()) DieWith(kName, st);
  auto cluster_token = PeerAuthFromOptions(*options);
  if (!cluster_token.ok()) DieWith(kName, cluster_token.status());
  // The /metrics exposer starts before any backend library loads (see server.h).
  auto process = ServerProcess::Init(*options);
  if (!process.ok()) DieWith(kName, process.status(), 1);

  std::string model_path = absl::GetFlag(FLAGS_model);
  if (model_path.empty()) model_path = gguf::DefaultModelPath();
  absl::StatusOr<TierBudgets> budgets =
      FitMemoryLimit(*backend::ParseDevice(absl::GetFlag(FLAGS_device)), model_path);
  if (!budgets.ok()) DieWith(kName, budgets.status());
  auto model = model::LlamaModel::Load(model_path);
  if (!model.ok()) DieWith(kName, model.status(), 1);
  const gguf::LlamaHparams& hp = (*model)->hparams();
  auto tokenizer = tok::Tokenizer::FromGguf((*model)->file());
  if (!tokenizer.ok()) DieWith(kName, tokenizer.status(), 1);
  auto chat = tok::ChatTemplate::FromGguf((*model)->file());
  if (!chat.ok()) KV_LOG_WARN("no chat template ({}); chat input is refused", chat.status().ToString());

  // The backend opens only now, after the /metrics exposer started (the CUDA
  // plugin's cuBLAS stops civetweb from starting threads).
  backend::BackendOptions bo;
  bo.cuda_plugin = absl::GetFlag(FLAGS_cuda_plugin);
  bo.max_batch_tokens = absl::GetFlag(FLAGS_max_batch_tokens);
  bo.cpu_threads = absl::GetFlag(FLAGS_threads);
  bo.cuda_graphs = absl::GetFlag(FLAGS_cuda_graphs);
  bo.cpu_kernel_level = *CpuKernelLevelFromFlags();
  auto backend = backend::OpenBackend(*backend::ParseDevice(absl::GetFlag(FLAGS_device)), bo);
  if (!backend.ok()) DieWith(kName, backend.status(), 1);
  KV_LOG_INFO("backend: {}", (*backend)->Describe());

  kv::KvCacheOptions ko;
  ko.shape = kv::KvShape{static_cast<int>(hp.n_layer),     static_cast<int>(hp.n_head_kv),
                         static_cast<int>(hp.head_dim),    *kv::ParseDtype(absl::GetFlag(FLAGS_kv_dtype)),
                         absl::GetFlag(FLAGS_page_tokens), static_cast<int>(hp.sliding_window)};
  ko.model_id = (*model)->model_id();
  ko.tier0_bytes = budgets->tier0;
  ko.tier1_bytes = budgets->tier1;
  ko.max_session_tokens = absl::GetFlag(FLAGS_max_context);
  ko.storage_factory = (*backend)->MakeTierStorageFactory();
  auto kv = kv::KvCacheManager::Create(ko);
  if (!kv.ok()) {
    DieWith(kName,
            absl::Status(kv.status().code(),
                         absl::StrCat(kv.status().message(), " (check --tier0_bytes / --tier1_bytes)")),
            1);
  }
  absl::StatusOr<model::ModelRunnerPtr> runner = (*backend)->CreateRunner(**model, **kv);
  if (!runner.ok()) DieWith(kName, runner.status(), 1);

  sched::EngineOptions eo;
  eo.max_batch_tokens = bo.max_batch_tokens;
  eo.max_step_time = absl::GetFlag(FLAGS_max_step_ms) < 0
                         ? absl::Milliseconds(-1)
                         : absl::Microseconds(static_cast<int64_t>(absl::GetFlag(FLAGS_max_step_ms) * 1000));
  eo.max_running = absl::GetFlag(FLAGS_max_running);
  eo.max_waiting = absl::GetFlag(FLAGS_max_waiting);
  eo.max_context = absl::GetFlag(FLAGS_max_context);
  eo.default_max_tokens = absl::GetFlag(FLAGS_default_max_tokens);
  eo.max_tokens_per_request = absl::GetFlag(FLAGS_max_tokens_per_request);
  eo.tenant_limits.max_sessions = absl::GetFlag(FLAGS_tenant_max_sessions);
  eo.tenant_limits.max_pinned_pages = absl::GetFlag(FLAGS_tenant_max_pinned_pages);
  eo.tenant_limits.max_requests = absl::GetFlag(FLAGS_tenant_max_requests);
  eo.session_idle_ttl = absl::GetFlag(FLAGS_session_idle_ttl);
  auto engine = sched::Engine::Create(eo, runner->get(), kv->get(), tokenizer->get());
  if (!engine.ok()) DieWith(kName, engine.status(), 1);

  std::string worker_id = absl::GetFlag(FLAGS_worker_id);
  if (worker_id.empty()) worker_id = DefaultWorkerId(options->grpc_address);
  service::WorkerMetrics metrics((*process)->metrics());
  metrics.SetInfo(backend::ParseDevice(absl::GetFlag(FLAGS_device))->ToString(),
                  cpu::CpuKernelLevelName(cpu::GetCpuKernelLevel()));

  service::WorkerServiceOptions so;
  so.worker_id = worker_id;
  so.model_id = (*model)->model_id();
  so.drain_deadline = absl::GetFlag(FLAGS_drain_deadline);
  so.cluster_token = *cluster_token;
  so.peer_channel_args = options->keepalive.ChannelArgs();
  // Migration calls other workers: with TLS configured, as a client presenting
  // this worker's certificate and trusting the CA that signs the workers.
  if (!options->tls_cert_file.empty()) {
    auto creds = MakePeerCredentials(*options);
    if (!creds.ok()) DieWith(kName, creds.status());
    so.peer_credentials = *creds;
  }
  service::WorkerService* service_ptr = nullptr;
  service::WatchHubOptions ho;
  ho.worker_id = worker_id;
  ho.model_id = so.model_id;
  ho.load_interval = absl::GetFlag(FLAGS_load_report_interval);
  ho.snapshot_part_entries = static_cast<size_t>(std::max(1, absl::GetFlag(FLAGS_watch_snapshot_part)));
  service::WatchHub hub(ho, kv->get(), engine->get(),
                        [&service_ptr] { return service_ptr != nullptr && service_ptr->draining(); });
  ServerProcess* proc = process->get();
  service::WorkerService service(
      so, engine->get(), kv->get(), tokenizer->get(), chat.ok() ? &*chat : nullptr, &hub, &metrics,
      [proc](bool ready) { proc->SetReady(ready); }, [proc] { proc->RequestShutdown(); });
  service_ptr = &service;
  (*engine)->SetStepCallback([&](const sched::StepStats& s) {
    metrics.OnStep(s);
    hub.Nudge();  // cache events of this step go out without waiting for the poll
  });

  // Gauges that mirror the cache and the queue are refreshed on every scrape.
  const int64_t page_bytes = ko.shape.page_bytes();
  (*process)->SetCollectHook(
      [&] { metrics.Refresh((*kv)->GetStats(), page_bytes, (*engine)->Load(), service.draining()); });

  KV_LOG_INFO(
      "model {} ({} layers, {} KV heads, head_dim {}); KV {} per token, tier 0 {} pages, tier 1 {} pages",
      so.model_id, hp.n_layer, hp.n_head_kv, hp.head_dim, ko.shape.bytes_per_token(),
      (*kv)->tier_capacity_pages(0), (*kv)->tier_capacity_pages(1));
  absl::Status served = (*process)->Serve({&service}, [&](absl::Time deadline) {
    // SIGTERM or a finished drain: stop taking work (readiness NOT_SERVING; the
    // routers see `draining` on Watch and migrate this worker's idle sessions
    // away, and each busy one once its stream ends), let running streams finish
    // for --drain_deadline but at most two thirds of --shutdown_deadline, then
    // cut the rest (their clients get UNAVAILABLE kStreamCutByDrainMessage and
    // the sessions keep what was sent, so they can move too), wait for the
    // sessions to leave, then end the Watch streams so the server can stop. All
    // within --shutdown_deadline.
    // A router watching now is the one to move the sessions; if it goes while
    // the streams finish (a restart, a replica rolled), another may come back.
    const bool watched = hub.subscribers() > 0;
    service.BeginDrain();
    const absl::Duration left = deadline - absl::Now();
    // Kept for the server's own stop after this: the health Watch streams end
    // OK (ServerProcess::Serve), not cancelled at a deadline already passed.
    const absl::Time sessions_deadline = deadline - std::min(absl::Seconds(1), left / 10);
    service.FinishOrCutStreams(std::min(left * 2 / 3, so.drain_deadline), left / 3);
    if (!service.WaitNoImports(sessions_deadline - absl::Now())) {
      KV_LOG_WARN("shutting down with a session import still in flight");
    }
    // Only a router that watches us can move the sessions. With none watching
    // since before the drain (a lone worker, or its routers stopped first, as a
    // whole deployment's teardown does) they end now; with one gone since, the
    // worker waits for one to return within the deadline.
    const size_t sessions = (*engine)->Sessions().size();
    const bool watched_now = hub.subscribers() > 0;
    if (!watched && !watched_now) {
      if (sessions > 0)
        KV_LOG_WARN("shutting down with {} sessions and no router to move them: they end here", sessions);
    } else {
      if (!watched_now && sessions > 0) {
        KV_LOG_WARN(
            "the routers that watched this worker went during its drain; waiting up to {} for one to "
            "return and move its {} sessions",
            absl::FormatDuration(sessions_deadline - absl::Now()), sessions);
      }
      if (!(*engine)->WaitNoSessions(sessions_deadline - absl::Now())) {
        KV_LOG_WARN("shutting down with {} sessions still here (no router moved them in time)",
                    (*engine)->Sessions().size());
      }
    }
    hub.Stop();
  });
  (*process)->SetCollectHook(nullptr);
  (*engine)->Stop();
  if (!served.ok()) DieWith(kName, served, 1);
  return 0;
}

}  // namespace
}  // namespace kvcache

int main(int argc, char** argv) {
  kvcache::InitProcess(argc, argv, kvcache::kName,
                       "kvcache-worker: KV-cache-centred LLM worker. See --help.");
  return kvcache::Run();
}
