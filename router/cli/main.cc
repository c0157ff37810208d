// kvcache-cli: chat, generate, inspect sessions and workers, migrate and drain,
// and run the multi-round QA benchmark, against a kvcache router (or one worker).
//
// Exit codes: 0 success; 1 usage error (bad subcommand or flag); 2 the router or
// worker cannot be reached; 3 a call failed (the server's status is printed);
// 130 a chat ended by Ctrl-C at its prompt.
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/random/random.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "router/cli/chat.h"
#include "router/cli/client.h"
#include "router/cli/format.h"

// Connection.
ABSL_FLAG(std::string, router, "127.0.0.1:7000",
          "Address (host:port) of the router, or of the worker with --target=worker");
ABSL_FLAG(
    std::string, target, "router",
    "Service at --router: router (kvcache.v1.KvCache/KvCacheAdmin) or worker (kvcache.v1.Worker, direct)");
ABSL_FLAG(std::string, token, "", "Bearer token, sent as `authorization: Bearer <token>` metadata");
ABSL_FLAG(std::string, tls_ca, "", "PEM file of CA certificates; TLS is used when set");
ABSL_FLAG(std::string, tls_cert, "", "PEM client certificate for mutual TLS (with --tls_key)");
ABSL_FLAG(std::string, tls_key, "", "PEM client key for mutual TLS (with --tls_cert)");
ABSL_FLAG(std::string, tls_server_name, "",
          "Name to check the server certificate against (default: the host of --router)");
ABSL_FLAG(absl::Duration, timeout, absl::Seconds(60),
          "Deadline of each call (one chat turn, one generate, ...)");
ABSL_FLAG(absl::Duration, connect_timeout, absl::Seconds(5),
          "How long to wait for the connection before giving up");

// Requests.
ABSL_FLAG(std::string, session, "",
          "Session id (chat: default a random cli-XXXX id; generate: default ephemeral; sessions: show one)");
ABSL_FLAG(std::string, system, "", "System prompt (chat, generate --chat)");
ABSL_FLAG(std::string, prompt, "", "generate: the input text (with --chat: the user message)");
ABSL_FLAG(bool, chat, false,
          "generate: send --prompt as a chat user message (with --system) instead of raw text");
ABSL_FLAG(std::string, mode, "full_context", "generate: full_context or append (continue --session)");
ABSL_FLAG(int32_t, max_tokens, 0, "Tokens to generate at most (0: the server default, 256)");
ABSL_FLAG(double, temperature, 0.0, "Sampling temperature (0: greedy)");
ABSL_FLAG(int32_t, top_k, 0, "Top-k cut (0: none)");
ABSL_FLAG(double, top_p, 0.0, "Nucleus cut (0 or 1: none)");
ABSL_FLAG(uint64_t, seed, 0, "Sampling seed (0: derived from the session id)");
ABSL_FLAG(std::vector<std::string>, stop, {}, "Comma-separated stop strings");
ABSL_FLAG(bool, ignore_eos, false, "Keep generating past the end-of-sequence token");
ABSL_FLAG(bool, pin, false, "Pin the session's pages (never evicted)");
ABSL_FLAG(bool, resume, false, "chat: continue the existing --session (first turn APPEND)");
ABSL_FLAG(bool, keep_session, false,
          "chat: keep the session on the server at exit (default: close it unless --session was given)");

// Sessions and admin.
ABSL_FLAG(std::string, close, "", "sessions: close this session");
ABSL_FLAG(
    std::string, to, "",
    "migrate: target worker id or address (router; empty lets it choose), or address (--target=worker)");
ABSL_FLAG(std::string, worker, "", "drain: worker id or address");
ABSL_FLAG(absl::Duration, drain_deadline, absl::ZeroDuration(),
          "drain: how long running streams may take (0: server default)");

// Benchmark.
ABSL_FLAG(std::string, bench_script, KVCACHE_SOURCE_DIR "/tests/bench/multi_round_qa.py",
          "bench: the multi-round QA benchmark script");

namespace kvcache::cli {
namespace {

constexpr char kName[] = "kvcache-cli";
constexpr int kExitUsage = 1;
constexpr int kExitUnreachable = 2;
constexpr int kExitCallFailed = 3;
constexpr int kExitInterrupted = 130;  // 128 + SIGINT, as a shell reports it

constexpr char kUsage[] = R"(kvcache-cli: talk to a kvcache router (or one worker).

usage: kvcache-cli [flags] SUBCOMMAND [flags]

subcommands:
  chat        interactive multi-turn chat on stdin (/quit or end of input ends it; Ctrl-C stops a
              reply, and at the prompt ends the chat)
              --session --system --max_tokens --temperature --top_p --top_k --seed --resume --keep_session
  generate    one request: --prompt=TEXT [--chat --system=...] [--session --mode=append], text then usage
  sessions    list sessions; --session=ID shows one; --close=ID closes one
  workers     the router's workers and their load
  migrate     --session=ID [--to=WORKER] moves a session
  drain       --worker=W drains a worker
  bench       runs tests/bench/multi_round_qa.py against --router; its flags follow `--`:
              kvcache-cli --router=HOST:PORT bench -- --users=8 --rounds=4

global flags: --router=HOST:PORT (127.0.0.1:7000) --target=router|worker --token=T --tls_ca=PEM
              --timeout=60s --connect_timeout=5s
exit codes: 0 ok, 1 usage, 2 unreachable, 3 call failed. --help lists every flag.)";

int UsageError(const std::string& message) {
  std::fprintf(stderr, "%s: %s\n\n%s\n", kName, message.c_str(), kUsage);
  return kExitUsage;
}

int CallFailed(const std::string& what, const absl::Status& status) {
  std::fprintf(stderr, "%s: %s failed: %s: %s\n", kName, what.c_str(),
               absl::StatusCodeToString(status.code()).c_str(), std::string(status.message()).c_str());
  return kExitCallFailed;
}

std::string RandomSessionId() {
  absl::BitGen gen;
  return absl::StrFormat("cli-%012x", absl::Uniform<uint64_t>(gen, 0, uint64_t{1} << 48));
}

v1::SamplingParams SamplingFromFlags() {
  v1::SamplingParams s;
  s.set_temperature(static_cast<float>(absl::GetFlag(FLAGS_temperature)));
  s.set_top_k(absl::GetFlag(FLAGS_top_k));
  s.set_top_p(static_cast<float>(absl::GetFlag(FLAGS_top_p)));
  s.set_seed(absl::GetFlag(FLAGS_seed));
  s.set_max_tokens(absl::GetFlag(FLAGS_max_tokens));
  for (const auto& stop : absl::GetFlag(FLAGS_stop)) {
    if (!stop.empty()) s.add_stop(stop);  // "x," splits into "x" and ""
  }
  s.set_ignore_eos(absl::GetFlag(FLAGS_ignore_eos));
  return s;
}

ClientOptions ClientOptionsFromFlags(Target target) {
  ClientOptions o;
  o.address = absl::GetFlag(FLAGS_router);
  o.target = target;
  o.token = absl::GetFlag(FLAGS_token);
  o.tls_ca_file = absl::GetFlag(FLAGS_tls_ca);
  o.tls_cert_file = absl::GetFlag(FLAGS_tls_cert);
  o.tls_key_file = absl::GetFlag(FLAGS_tls_key);
  o.tls_server_name = absl::GetFlag(FLAGS_tls_server_name);
  o.timeout = absl::GetFlag(FLAGS_timeout);
  o.connect_timeout = absl::GetFlag(FLAGS_connect_timeout);
  return o;
}

int RunChatCommand(Client& client) {
  ChatOptions o;
  const bool named = !absl::GetFlag(FLAGS_session).empty();
  o.session_id = named ? absl::GetFlag(FLAGS_session) : RandomSessionId();
  o.system_prompt = absl::GetFlag(FLAGS_system);
  o.sampling = SamplingFromFlags();
  o.pin = absl::GetFlag(FLAGS_pin);
  o.resume = absl::GetFlag(FLAGS_resume);
  if (o.resume && !named) return UsageError("--resume needs --session=ID");
  o.prompt = isatty(STDIN_FILENO) != 0;
  o.color = isatty(STDERR_FILENO) != 0;
  if (o.prompt) {
    std::cerr << "session " << o.session_id << " via " << TargetName(client.options().target) << " "
              << client.options().address << "; /quit or end of input exits\n";
  }
  GenerateFn generate = [&client](const v1::GenerateRequest& req,
                                  const std::function<void(const v1::GenerateResponse::Token&)>& on_token,
                                  int* tokens_seen) { return client.Generate(req, on_token, tokens_seen); };
  // Ctrl-C (SIGINT, blocked in every thread: Main) stops the reply being
  // generated, and the chat goes on; at the prompt it ends the chat, closing
  // the session as the end of input does.
  const bool close_at_exit = !named && !absl::GetFlag(FLAGS_keep_session);
  absl::Mutex mu;
  bool done = false;
  std::thread interrupts([&client, &o, &mu, &done, close_at_exit] {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    for (;;) {
      int sig = 0;
      if (sigwait(&set, &sig) != 0) continue;
      absl::MutexLock lock(&mu);
      if (done) return;
      if (client.CancelGenerate()) continue;
      std::cerr << "\n";
      if (close_at_exit) (void)client.CloseSession(o.session_id);
      std::_Exit(kExitInterrupted);
    }
  });
  ChatResult result = RunChat(o, generate, std::cin, std::cout, std::cerr);
  {
    absl::MutexLock lock(&mu);
    done = true;
  }
  interrupts.detach();  // blocked in sigwait until the process ends
  // A session named on the command line is the user's to keep; a random one is
  // not reachable again, so it is closed unless asked otherwise.
  if (result.turns > 0 && !named && !absl::GetFlag(FLAGS_keep_session)) {
    auto closed = client.CloseSession(o.session_id);
    if (!closed.ok() && closed.status().code() != absl::StatusCode::kNotFound) {
      std::cerr << kName << ": closing session " << o.session_id << ": " << closed.status().message() << "\n";
    }
  } else if (result.turns > 0) {
    std::cerr << "session " << o.session_id << " kept\n";
  }
  return result.failed_turns > 0 ? kExitCallFailed : 0;
}

int RunGenerate(Client& client) {
  const std::string prompt = absl::GetFlag(FLAGS_prompt);
  if (prompt.empty()) return UsageError("generate needs --prompt=TEXT");
  const std::string mode = absl::GetFlag(FLAGS_mode);
  if (mode != "full_context" && mode != "append") return UsageError("--mode must be full_context or append");
  v1::GenerateRequest req;
  req.set_session_id(absl::GetFlag(FLAGS_session));
  req.set_mode(mode == "append" ? v1::APPEND : v1::FULL_CONTEXT);
  if (req.mode() == v1::APPEND && req.session_id().empty())
    return UsageError("--mode=append needs --session=ID");
  if (absl::GetFlag(FLAGS_chat)) {
    v1::ChatMessages* chat = req.mutable_input()->mutable_chat();
    if (!absl::GetFlag(FLAGS_system).empty()) {
      v1::ChatMessage* m = chat->add_messages();
      m->set_role("system");
      m->set_content(absl::GetFlag(FLAGS_system));
    }
    v1::ChatMessage* m = chat->add_messages();
    m->set_role("user");
    m->set_content(prompt);
  } else {
    req.mutable_input()->set_text(prompt);
  }
  *req.mutable_sampling() = SamplingFromFlags();
  req.set_pin(absl::GetFlag(FLAGS_pin));
  auto final =
      client.Generate(req, [](const v1::GenerateResponse::Token& t) { std::cout << t.text() << std::flush; });
  std::cout << "\n" << std::flush;
  if (!final.ok()) return CallFailed("Generate", final.status());
  std::cerr << UsageSummary(*final);
  return 0;
}

int RunSessions(Client& client) {
  const std::string close = absl::GetFlag(FLAGS_close);
  const std::string session = absl::GetFlag(FLAGS_session);
  if (!close.empty()) {
    auto r = client.CloseSession(close);
    if (!r.ok()) return CallFailed("CloseSession", r.status());
    std::cout << "closed session " << close << " (" << r->pages_freed() << " pages freed)\n";
    return 0;
  }
  if (!session.empty()) {
    auto r = client.GetSession(session);
    if (!r.ok()) return CallFailed("GetSession", r.status());
    std::cout << SessionDetail(*r);
    return 0;
  }
  auto r = client.ListSessions();
  if (!r.ok()) return CallFailed("ListSessions", r.status());
  std::cout << SessionsTable(*r);
  return 0;
}

int RunWorkers(Client& client) {
  auto r = client.ListWorkers();
  if (!r.ok()) return CallFailed("ListWorkers", r.status());
  std::cout << WorkersTable(*r);
  return 0;
}

int RunMigrate(Client& client) {
  const std::string session = absl::GetFlag(FLAGS_session);
  if (session.empty()) return UsageError("migrate needs --session=ID");
  if (absl::GetFlag(FLAGS_target) == "worker" && absl::GetFlag(FLAGS_to).empty())
    return UsageError("migrate with --target=worker needs --to=HOST:PORT (the target worker)");
  auto r = client.MigrateSession(session, absl::GetFlag(FLAGS_to));
  if (!r.ok()) return CallFailed("MigrateSession", r.status());
  std::cout << absl::StrFormat("migrated session %s to %s: %d bytes in %.1f ms (paused %.1f ms)\n", session,
                               r->session().worker_id(), r->bytes_moved(), r->total_us() / 1000.0,
                               r->pause_us() / 1000.0);
  return 0;
}

int RunDrain(Client& client) {
  const std::string worker = absl::GetFlag(FLAGS_worker);
  if (worker.empty() && client.options().target == Target::kRouter)
    return UsageError("drain needs --worker=W");
  const int32_t deadline_ms =
      static_cast<int32_t>(absl::ToInt64Milliseconds(absl::GetFlag(FLAGS_drain_deadline)));
  auto r = client.Drain(worker, deadline_ms);
  if (!r.ok()) return CallFailed("Drain", r.status());
  std::cout << absl::StrFormat("drained %s: %d sessions migrated, %d offloaded, %d dropped\n",
                               worker.empty() ? client.options().address : worker, r->sessions_migrated(),
                               r->sessions_offloaded(), r->sessions_dropped());
  return 0;
}

// Replaces this process with the Python benchmark, passing the connection flags
// and everything after `--`.
int RunBench(const std::vector<std::string>& extra) {
  const std::string script = absl::GetFlag(FLAGS_bench_script);
  if (access(script.c_str(), R_OK) != 0) {
    std::fprintf(stderr, "%s: benchmark script %s not found (set --bench_script)\n", kName, script.c_str());
    return kExitUsage;
  }
  std::vector<std::string> args = {"python3", script, "--address=" + absl::GetFlag(FLAGS_router),
                                   "--target=" + absl::GetFlag(FLAGS_target)};
  if (!absl::GetFlag(FLAGS_token).empty()) args.push_back("--token=" + absl::GetFlag(FLAGS_token));
  if (!absl::GetFlag(FLAGS_tls_ca).empty()) args.push_back("--tls_ca=" + absl::GetFlag(FLAGS_tls_ca));
  args.insert(args.end(), extra.begin(), extra.end());
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  execvp("python3", argv.data());
  std::fprintf(stderr, "%s: cannot run python3: %s\n", kName, std::strerror(errno));
  return kExitUsage;
}

// The first flag in argv (before `--`) that no ABSL_FLAG defines, or "". Checked
// before parsing so that a typo prints the usage, not only absl's one line.
std::string FirstUnknownFlag(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (arg == "--") break;
    if (arg.size() < 2 || arg[0] != '-') continue;
    absl::string_view name = arg.substr(arg[1] == '-' ? 2 : 1);
    name = name.substr(0, name.find('='));
    // absl's usage flags are handled by ParseCommandLine, not registered.
    for (absl::string_view builtin :
         {"help", "helpfull", "helpshort", "helppackage", "version", "only_check_args"}) {
      if (name == builtin) name = "";
    }
    if (name.empty()) continue;
    if (absl::FindCommandLineFlag(name) != nullptr) continue;
    if (absl::ConsumePrefix(&name, "no") && absl::FindCommandLineFlag(name) != nullptr) continue;
    return std::string(arg.substr(0, arg.find('=')));
  }
  return "";
}

int Main(int argc, char** argv) {
  absl::SetProgramUsageMessage(kUsage);
  absl::FlagsUsageConfig usage_config;
  usage_config.contains_help_flags = [](absl::string_view file) {
    return absl::StrContains(file, "router/cli/");
  };
  usage_config.contains_helpshort_flags = usage_config.contains_help_flags;
  absl::SetFlagsUsageConfig(usage_config);
  const std::string unknown = FirstUnknownFlag(argc, argv);
  if (!unknown.empty()) return UsageError(absl::StrCat("unknown flag ", unknown));
  std::vector<char*> positional = absl::ParseCommandLine(argc, argv);
  if (positional.size() < 2) return UsageError("no subcommand");
  const std::string command = positional[1];
  std::vector<std::string> rest(positional.begin() + 2, positional.end());

  static const char* const kCommands[] = {"chat",    "generate", "sessions", "workers",
                                          "migrate", "drain",    "bench"};
  bool known = false;
  for (const char* c : kCommands) known = known || command == c;
  if (!known) return UsageError(absl::StrCat("unknown subcommand '", command, "'"));
  if (command != "bench" && !rest.empty()) {
    return UsageError(absl::StrCat("unexpected argument '", rest.front(), "' after ", command));
  }
  auto target = ParseTarget(absl::GetFlag(FLAGS_target));
  if (!target.ok()) return UsageError(std::string(target.status().message()));
  if (command == "bench") return RunBench(rest);
  if (command == "workers" && *target != Target::kRouter) return UsageError("workers needs --target=router");

  if (command == "chat") {
    // Before any thread starts: a chat's Ctrl-C goes to its own thread
    // (RunChatCommand), in every thread gRPC starts too.
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    pthread_sigmask(SIG_BLOCK, &set, nullptr);
  }
  auto client = Client::Connect(ClientOptionsFromFlags(*target));
  if (!client.ok()) {
    std::fprintf(stderr, "%s: %s\n", kName, std::string(client.status().message()).c_str());
    return client.status().code() == absl::StatusCode::kUnavailable ? kExitUnreachable : kExitUsage;
  }
  Client& c = **client;
  if (command == "chat") return RunChatCommand(c);
  if (command == "generate") return RunGenerate(c);
  if (command == "sessions") return RunSessions(c);
  if (command == "workers") return RunWorkers(c);
  if (command == "migrate") return RunMigrate(c);
  return RunDrain(c);
}

}  // namespace
}  // namespace kvcache::cli

int main(int argc, char** argv) { return kvcache::cli::Main(argc, argv); }
