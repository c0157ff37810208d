// kvcache-router: the front door. Routes each session to a worker by cache
// affinity (session, then prefix overlap against load) and proxies its stream.
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "common/gguf/llama_hparams.h"
#include "common/gguf/model_path.h"
#include "common/init.h"
#include "common/logging.h"
#include "common/server.h"
#include "common/status_macros.h"
#include "common/tokenizer/chat_template.h"
#include "common/tokenizer/tokenizer.h"
#include "router/auth.h"
#include "router/directory.h"
#include "router/http_gateway.h"
#include "router/router_metrics.h"
#include "router/router_service.h"
#include "router/worker_pool.h"

ABSL_FLAG(std::string, workers, "", "Comma-separated worker addresses host:port (static membership)");
ABSL_FLAG(
    std::string, worker_dns, "",
    "Comma-separated DNS names whose every address is a worker (a Kubernetes headless Service): name:port "
    "(system resolver) or dns://HOST:PORT/name:port (that DNS server)");
ABSL_FLAG(absl::Duration, dns_refresh, absl::Seconds(10), "How often --worker_dns is re-resolved");
ABSL_FLAG(std::string, model, "",
          "GGUF file whose tokenizer the router uses for prefix hashes (same as the workers')");
ABSL_FLAG(std::string, placement, "affinity", "Placement policy: affinity, round_robin or random");
ABSL_FLAG(double, session_balance, 1.0,
          "Affinity: a new session skips a worker that would then hold more than this factor times its share "
          "of the sessions (shares follow KV pages, both tiers) while another would not; 0 disables");
ABSL_FLAG(
    double, load_balance, 1.5,
    "Affinity: a worker whose queued work exceeds this factor times the mean (plus 256 tokens) is skipped "
    "while another is not; 0 disables");
ABSL_FLAG(std::string, auth_tokens_file, "",
          "Client bearer tokens: lines 'TOKEN TENANT [admin]'. Without it the router starts only with "
          "--allow_unauthenticated");
ABSL_FLAG(absl::Duration, health_timeout, absl::Seconds(3), "A worker silent this long is unhealthy");
ABSL_FLAG(absl::Duration, forget_after, absl::Seconds(30), "A worker unreachable this long is forgotten");
ABSL_FLAG(absl::Duration, rebalance_interval, absl::Seconds(5), "Rebalancing period (0 disables)");
ABSL_FLAG(double, rebalance_low_free, 0.10,
          "A worker whose free fraction of tier-0 pages is under this gives sessions away");
ABSL_FLAG(double, rebalance_high_free, 0.50,
          "Only a worker with at least this free fraction of tier-0 pages takes them (> low: hysteresis)");
ABSL_FLAG(int32_t, rebalance_batch, 4, "Sessions one hot worker gives away per rebalancing period");
ABSL_FLAG(int32_t, rebalance_min_tokens, 64, "Smaller sessions are not moved (recomputing them is cheaper)");
ABSL_FLAG(int32_t, max_attempts, 3, "Workers tried per request");
ABSL_FLAG(absl::Duration, session_lookup_wait, absl::Seconds(1),
          "How long an APPEND waits for the directory to show its session (new, or moved after its worker "
          "answered NOT_FOUND)");
ABSL_FLAG(absl::Duration, drain_move_wait, absl::Seconds(10),
          "How long an APPEND to a session on a draining worker waits for the session to move elsewhere");
ABSL_FLAG(int32_t, min_ready_workers, 1, "Readiness is SERVING while at least this many workers are healthy");
ABSL_FLAG(std::string, worker_tls_ca, "",
          "PEM CA that signs the workers' certificates (enables TLS to workers)");
ABSL_FLAG(std::string, worker_tls_cert, "", "PEM client certificate for mutual TLS to workers");
ABSL_FLAG(std::string, worker_tls_key, "", "PEM key of --worker_tls_cert");
ABSL_FLAG(
    std::string, http_listen, "",
    "OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models, /health, /ready) on "
    "host:port (port 0 picks one); empty disables");
ABSL_FLAG(std::string, served_model_name, "",
          "Comma-separated names the HTTP API's 'model' may take (default: the --model file's name without "
          ".gguf)");
ABSL_FLAG(absl::Duration, http_request_timeout, absl::Minutes(10),
          "Deadline of an HTTP request without an x-request-timeout-ms header");

namespace kvcache {
namespace {

constexpr char kName[] = "kvcache-router";

absl::StatusOr<std::string> ReadPem(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> WorkerCredentials() {
  const std::string ca = absl::GetFlag(FLAGS_worker_tls_ca), cert = absl::GetFlag(FLAGS_worker_tls_cert),
                    key = absl::GetFlag(FLAGS_worker_tls_key);
  if (ca.empty()) {
    if (!cert.empty() || !key.empty())
      return absl::InvalidArgumentError("--worker_tls_cert/key need --worker_tls_ca");
    return grpc::InsecureChannelCredentials();
  }
  grpc::SslCredentialsOptions o;
  KVCACHE_ASSIGN_OR_RETURN(o.pem_root_certs, ReadPem(ca));
  if (cert.empty() != key.empty())
    return absl::InvalidArgumentError("--worker_tls_cert and --worker_tls_key go together");
  if (!cert.empty()) {
    KVCACHE_ASSIGN_OR_RETURN(o.pem_cert_chain, ReadPem(cert));
    KVCACHE_ASSIGN_OR_RETURN(o.pem_private_key, ReadPem(key));
  }
  return grpc::SslCredentials(o);
}

int Run() {
  auto options = ServerOptionsFromFlags(kName);
  if (!options.ok()) DieWith(kName, options.status());
  auto mode = router::ParsePlacementMode(absl::GetFlag(FLAGS_placement));
  if (!mode.ok()) DieWith(kName, mode.status());
  const std::vector<std::string> workers =
      absl::StrSplit(absl::GetFlag(FLAGS_workers), ',', absl::SkipEmpty());
  const std::vector<std::string> dns =
      absl::StrSplit(absl::GetFlag(FLAGS_worker_dns), ',', absl::SkipEmpty());
  if (!(absl::GetFlag(FLAGS_rebalance_low_free) >= 0 &&
        absl::GetFlag(FLAGS_rebalance_low_free) < absl::GetFlag(FLAGS_rebalance_high_free) &&
        absl::GetFlag(FLAGS_rebalance_high_free) <= 1)) {
    DieWith(kName,
            absl::InvalidArgumentError(
                "want 0 <= --rebalance_low_free < --rebalance_high_free <= 1 (the gap is the hysteresis)"));
  }
  if (absl::GetFlag(FLAGS_rebalance_batch) < 1 || absl::GetFlag(FLAGS_rebalance_min_tokens) < 0) {
    DieWith(kName, absl::InvalidArgumentError("--rebalance_batch must be >= 1, --rebalance_min_tokens >= 0"));
  }
  if (const double b = absl::GetFlag(FLAGS_session_balance); !(b == 0 || b >= 1)) {
    DieWith(kName, absl::InvalidArgumentError("--session_balance must be 0 (off) or >= 1"));
  }
  if (const double b = absl::GetFlag(FLAGS_load_balance); !(b == 0 || b >= 1)) {
    DieWith(kName, absl::InvalidArgumentError("--load_balance must be 0 (off) or >= 1"));
  }
  if (absl::GetFlag(FLAGS_max_attempts) < 1)
    DieWith(kName, absl::InvalidArgumentError("--max_attempts must be >= 1"));
  if (absl::GetFlag(FLAGS_http_request_timeout) <= absl::ZeroDuration() ||
      absl::GetFlag(FLAGS_health_timeout) <= absl::ZeroDuration()) {
    // Zero would answer every HTTP request 504, or keep every worker unhealthy.
    DieWith(kName,
            absl::InvalidArgumentError("--http_request_timeout and --health_timeout must be positive"));
  }
  if (absl::GetFlag(FLAGS_dns_refresh) <= absl::ZeroDuration()) {
    // Zero would re-resolve without pause: a busy loop, and a flood on the DNS server.
    DieWith(kName, absl::InvalidArgumentError("--dns_refresh must be positive"));
  }
  if (absl::GetFlag(FLAGS_session_lookup_wait) < absl::ZeroDuration() ||
      absl::GetFlag(FLAGS_drain_move_wait) < absl::ZeroDuration()) {
    DieWith(kName, absl::InvalidArgumentError("--session_lookup_wait and --drain_move_wait must be >= 0"));
  }
  for (const auto& a : workers) {
    // host:port, the port 1..65535; an IPv6 host in brackets ([::1]:50051).
    const size_t colon = a.rfind(':');
    int port = 0;
    const std::string host = colon == std::string::npos ? "" : a.substr(0, colon);
    const bool bracketed = absl::StartsWith(host, "[") && absl::EndsWith(host, "]");
    if (colon == std::string::npos || host.empty() || (!bracketed && absl::StrContains(host, ':')) ||
        !absl::SimpleAtoi(a.substr(colon + 1), &port) || port < 1 || port > 65535) {
      DieWith(kName, absl::InvalidArgumentError(
                         absl::StrCat("worker address '", a, "' needs host:port (port 1-65535)")));
    }
  }
  for (const auto& name : dns) {
    if (auto t = router::ParseDnsTarget(name); !t.ok()) DieWith(kName, t.status());
  }
  if (workers.empty() && dns.empty()) {
    KV_LOG_WARN("no workers (--workers, --worker_dns): every request gets UNAVAILABLE");
  }
  auto creds = WorkerCredentials();
  if (!creds.ok()) DieWith(kName, creds.status());
  // Clients: bearer tokens, and anonymous callers only when asked for.
  std::unique_ptr<router::Authenticator> auth =
      std::make_unique<router::Authenticator>(options->allow_unauthenticated);
  if (!absl::GetFlag(FLAGS_auth_tokens_file).empty()) {
    auto a = router::Authenticator::FromFile(absl::GetFlag(FLAGS_auth_tokens_file),
                                             options->allow_unauthenticated);
    if (!a.ok()) DieWith(kName, a.status());
    auth = std::move(*a);
  } else if (!options->allow_unauthenticated) {
    DieWith(kName, absl::FailedPreconditionError(
                       "clients authenticate with bearer tokens: give --auth_tokens_file (lines 'TOKEN "
                       "TENANT [admin]'), or --allow_unauthenticated to serve anonymous callers as tenant "
                       "'default' (admin calls still need an admin token)"));
  }
  if (options->allow_unauthenticated) {
    KV_LOG_WARN(
        "--allow_unauthenticated: callers without a token are served as tenant 'default' (admin calls "
        "still need an admin token from --auth_tokens_file)");
  }
  // Workers: the fleet's cluster token goes with every call to them.
  ClusterToken cluster_token;
  if (!options->cluster_token_file.empty()) {
    auto t = ClusterToken::FromFile(options->cluster_token_file);
    if (!t.ok()) DieWith(kName, t.status());
    cluster_token = *t;
  }
  auto process = ServerProcess::Init(*options);
  if (!process.ok()) DieWith(kName, process.status(), 1);

  std::string model_path = absl::GetFlag(FLAGS_model);
  if (model_path.empty()) model_path = gguf::DefaultModelPath();
  auto file = gguf::OpenModelFile(model_path);
  if (!file.ok()) DieWith(kName, file.status(), 1);
  auto tokenizer = tok::Tokenizer::FromGguf(**file);
  if (!tokenizer.ok()) DieWith(kName, tokenizer.status(), 1);
  auto chat = tok::ChatTemplate::FromGguf(**file);

  router::RouterMetrics metrics((*process)->metrics());
  router::Directory directory;
  router::WorkerPoolOptions po;
  po.on_dns_result = [&metrics](const char* result) { metrics.OnDnsResult(result); };
  po.health_timeout = absl::GetFlag(FLAGS_health_timeout);
  po.forget_after = absl::GetFlag(FLAGS_forget_after);
  po.dns_refresh = absl::GetFlag(FLAGS_dns_refresh);
  po.credentials = *creds;
  po.cluster_token = cluster_token;
  po.channel_args = options->keepalive.ChannelArgs();
  // Workers that serve another model take no requests (WorkerPoolOptions::model_id).
  if (auto hp = gguf::LoadLlamaHparams(**file); hp.ok()) {
    po.model_id = gguf::ModelId(**file, *hp);
    KV_LOG_INFO("model {}: workers serving another model get no requests", po.model_id);
  } else {
    KV_LOG_WARN("--model {}: {}; workers' models are not checked", model_path, hp.status().ToString());
  }
  router::WorkerPool pool(po, &directory);
  if (!workers.empty()) pool.SetAddresses(workers);
  for (const auto& name : dns) {
    if (absl::Status st = pool.AddDnsName(name); !st.ok()) DieWith(kName, st);
  }
  if (workers.empty() && dns.empty())
    KV_LOG_WARN("no --workers or --worker_dns: every request will be UNAVAILABLE");

  router::RouterOptions ro;
  ro.mode = *mode;
  ro.max_attempts = absl::GetFlag(FLAGS_max_attempts);
  ro.session_lookup_wait = absl::GetFlag(FLAGS_session_lookup_wait);
  ro.drain_move_wait = absl::GetFlag(FLAGS_drain_move_wait);
  ro.rebalance_interval = absl::GetFlag(FLAGS_rebalance_interval);
  ro.rebalance_low_free = absl::GetFlag(FLAGS_rebalance_low_free);
  ro.rebalance_high_free = absl::GetFlag(FLAGS_rebalance_high_free);
  ro.rebalance_batch = absl::GetFlag(FLAGS_rebalance_batch);
  ro.rebalance_min_tokens = absl::GetFlag(FLAGS_rebalance_min_tokens);
  ro.placement.session_cap_factor = absl::GetFlag(FLAGS_session_balance);
  ro.placement.cap_factor = absl::GetFlag(FLAGS_load_balance);
  router::RouterService service(ro, &pool, &directory, tokenizer->get(), chat.ok() ? &*chat : nullptr,
                                auth.get(), &metrics);
  router::AdminService admin(&service);
  std::unique_ptr<router::HttpGateway> http;
  if (!absl::GetFlag(FLAGS_http_listen).empty()) {
    router::HttpGatewayOptions ho;
    ho.listen = absl::GetFlag(FLAGS_http_listen);
    for (absl::string_view name :
         absl::StrSplit(absl::GetFlag(FLAGS_served_model_name), ',', absl::SkipWhitespace())) {
      ho.model_names.emplace_back(absl::StripAsciiWhitespace(name));  // "a, b" names "b", not " b"
    }
    if (ho.model_names.empty()) {
      std::string name = model_path.substr(model_path.find_last_of('/') + 1);
      if (absl::EndsWith(name, ".gguf")) name.resize(name.size() - 5);
      ho.model_names.push_back(name);
    }
    ho.request_timeout = absl::GetFlag(FLAGS_http_request_timeout);
    ho.auth = auth.get();
    ho.on_refused = [&metrics](absl::StatusCode code) {
      metrics.OnRequestDone(absl::StatusCodeToString(code));
    };
    http = std::make_unique<router::HttpGateway>(std::move(ho));
    (*process)->AddFrontend(http.get());  // started and stopped by Serve
  }
  (*process)->SetCollectHook([&] {
    metrics.SetWorkers(pool.Workers());
    metrics.SetStaleCopies(directory.stale_copies());
    metrics.SetSessionsLost(directory.sessions_lost());
  });

  // Readiness follows the pool: a router without enough healthy workers takes
  // no traffic.
  const size_t min_ready = static_cast<size_t>(std::max(0, absl::GetFlag(FLAGS_min_ready_workers)));
  absl::Notification stop_readiness;
  (*process)->SetReady(min_ready == 0);
  std::thread readiness([&] {
    bool ready = min_ready == 0;
    while (!stop_readiness.HasBeenNotified()) {
      if (pool.AwaitHealthy(min_ready, !ready, absl::Milliseconds(500))) {
        ready = !ready;
        (*process)->SetReady(ready);
        KV_LOG_INFO("readiness {}: {} healthy workers needed", ready ? "SERVING" : "NOT_SERVING", min_ready);
      }
    }
  });
  absl::Status served = (*process)->Serve({&service, &admin}, [&](absl::Time) {
    stop_readiness.Notify();
    service.RefuseNewCalls();
    pool.Stop();
  });
  // Serve runs the hook above only once it has started; when it fails to start
  // (an --http_listen it cannot bind, say) the readiness loop must stop too.
  if (!stop_readiness.HasBeenNotified()) stop_readiness.Notify();
  readiness.join();
  (*process)->SetCollectHook(nullptr);
  service.Shutdown();
  if (!served.ok()) DieWith(kName, served, 1);
  return 0;
}

}  // namespace
}  // namespace kvcache

int main(int argc, char** argv) {
  kvcache::InitProcess(argc, argv, kvcache::kName,
                       "kvcache-router: routes sessions to workers by cache affinity. See --help.");
  return kvcache::Run();
}
