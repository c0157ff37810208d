// kvcache-demo: the scripted conversation behind `scripts/run.sh`.
//
// Talks to a running router: several users hold multi-turn chats (a shared
// system prompt, their own questions). After the first turn each session is
// forked into a twin (the fork shares its pages) that then receives exactly the
// same turns. The demo prints, per turn, the worker, the cached and prompt
// tokens, tokens restored from host RAM, time to first token and decode speed.
// Midway it migrates one user's session to another worker (through the admin
// API); the workers' small tier-0 budget forces offload and restore along the
// way. At the end every user's later replies are compared with its twin's: the
// cache moved bytes between tiers and workers, never recomputed them, so the
// tokens must be identical.
#include <chrono>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/flags_usage.h"
#include "common/peer_auth.h"
#include "grpcpp/grpcpp.h"
#include "kvcache/v1/router.grpc.pb.h"

ABSL_FLAG(std::string, router, "127.0.0.1:7000", "Router address host:port");
ABSL_FLAG(int32_t, users, 3, "Users in the conversation");
ABSL_FLAG(std::string, token, "",
          "Bearer token for the router (an admin token: the demo forks and migrates sessions)");
ABSL_FLAG(int32_t, max_tokens, 40, "Tokens per reply");

namespace kvcache {
namespace {

constexpr char kSystem[] =
    "You are a concise assistant for a small seaside town's visitor centre. Answer in one or two short "
    "sentences, stay friendly, and mention a local detail when it helps: the lighthouse on the north cliff, "
    "the Saturday fish market by the harbour, the ferry to the island that leaves at nine and at three, "
    "the coastal path that is closed after storms, and the cafe at the old station that serves crab soup.";

const std::vector<std::vector<std::string>> kQuestions = {
    {"When does the ferry to the island leave?", "Is there anything to eat near the station?",
     "Can I walk along the coast today after last night's storm?", "What should I see before I leave?"},
    {"Where is the fish market and when is it open?", "Is the lighthouse open to visitors?",
     "How do I get to the island and back on the same day?", "Any tips for a rainy afternoon?"},
    {"What is the best view in town?", "Do you recommend the crab soup?",
     "Which ferry should I take if I want to see the market first?", "Thanks! Anything else?"},
};

struct TurnResult {
  std::vector<int32_t> tokens;
  std::string text;
  v1::GenerateResponse::Final final;
  grpc::Status status;
};

class Demo {
 public:
  explicit Demo(std::shared_ptr<grpc::Channel> channel)
      : api_(v1::KvCache::NewStub(channel)), admin_(v1::KvCacheAdmin::NewStub(channel)) {}

  TurnResult Turn(const std::string& session, int turn, const std::string& question, bool print) {
    v1::GenerateRequest req;
    req.set_session_id(session);
    req.set_mode(turn == 0 ? v1::FULL_CONTEXT : v1::APPEND);
    auto* chat = req.mutable_input()->mutable_chat();
    if (turn == 0) {
      auto* sys = chat->add_messages();
      sys->set_role("system");
      sys->set_content(kSystem);
    }
    auto* m = chat->add_messages();
    m->set_role("user");
    m->set_content(question);
    req.mutable_sampling()->set_max_tokens(absl::GetFlag(FLAGS_max_tokens));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::minutes(5));
    auto reader = api_->Generate(&ctx, req);
    TurnResult r;
    v1::GenerateResponse msg;
    if (print) std::printf("    assistant: ");
    while (reader->Read(&msg)) {
      if (msg.has_token()) {
        r.tokens.push_back(msg.token().id());
        r.text += msg.token().text();
        if (print) {
          std::fputs(msg.token().text().c_str(), stdout);
          std::fflush(stdout);
        }
      } else {
        r.final = msg.final();
      }
    }
    r.status = reader->Finish();
    if (print) std::printf("\n");
    return r;
  }

  static void PrintUsage(const std::string& label, const TurnResult& r) {
    if (!r.status.ok()) {
      std::printf("    %-14s ERROR %s\n", label.c_str(), r.status.error_message().c_str());
      return;
    }
    const auto& u = r.final.usage();
    const double ttft_ms = u.time_to_first_token_us() / 1000.0;
    const double decode_s = (u.total_time_us() - u.time_to_first_token_us()) / 1e6;
    const double tps = decode_s > 0 ? (u.generated_tokens() - 1) / decode_s : 0;
    std::printf(
        "    %-14s worker %-4s cached %4d / %4d prompt tokens (%3.0f%%)  restored %4d  ttft %7.1f ms  %5.1f "
        "tok/s\n",
        label.c_str(), r.final.worker_id().c_str(), u.cached_tokens(), u.prompt_tokens(),
        u.prompt_tokens() > 0 ? 100.0 * u.cached_tokens() / u.prompt_tokens() : 0.0, u.restored_tokens(),
        ttft_ms, tps);
    std::fflush(stdout);
  }

  std::string WorkerOf(const std::string& session) {
    grpc::ClientContext ctx;
    v1::SessionRequest req;
    req.set_session_id(session);
    v1::SessionInfo info;
    return api_->GetSession(&ctx, req, &info).ok() ? info.worker_id() : "?";
  }

  void PrintWorkers() {
    grpc::ClientContext ctx;
    v1::ListWorkersRequest req;
    v1::ListWorkersResponse resp;
    if (grpc::Status st = admin_->ListWorkers(&ctx, req, &resp); !st.ok()) {
      std::printf("    (cannot list workers: %s)\n", st.error_message().c_str());
      return;
    }
    for (const auto& w : resp.workers()) {
      const auto& l = w.load();
      std::printf("    %-4s %-9s sessions %2d  device pages free %4lld / %4lld  host pages used %4lld\n",
                  w.worker_id().c_str(), w.health().c_str(), w.sessions(),
                  static_cast<long long>(l.pages_free_device()),
                  static_cast<long long>(l.pages_total_device()),
                  static_cast<long long>(l.pages_total_host() - l.pages_free_host()));
    }
  }

  // Closes `session` if it exists (a previous run's).
  void Close(const std::string& session) {
    grpc::ClientContext ctx;
    v1::SessionRequest req;
    req.set_session_id(session);
    v1::CloseSessionResponse resp;
    (void)api_->CloseSession(&ctx, req, &resp);
  }

  grpc::Status Fork(const std::string& session, const std::string& fork) {
    grpc::ClientContext ctx;
    v1::ForkSessionRequest req;
    req.set_session_id(session);
    req.set_new_session_id(fork);
    v1::SessionInfo info;
    return api_->ForkSession(&ctx, req, &info);
  }

  grpc::Status Migrate(const std::string& session, const std::string& to, v1::MigrateSessionResponse* resp) {
    grpc::ClientContext ctx;
    v1::AdminMigrateRequest req;
    req.set_session_id(session);
    req.set_target_worker(to);
    return admin_->MigrateSession(&ctx, req, resp);
  }

 private:
  std::unique_ptr<v1::KvCache::Stub> api_;
  std::unique_ptr<v1::KvCacheAdmin::Stub> admin_;
};

int Run() {
  const std::string token = absl::GetFlag(FLAGS_token);
  auto channel =
      token.empty()
          ? grpc::CreateChannel(absl::GetFlag(FLAGS_router), grpc::InsecureChannelCredentials())
          : NewBearerChannel(absl::GetFlag(FLAGS_router), grpc::InsecureChannelCredentials(), token);
  if (!channel->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(10))) {
    std::fprintf(stderr, "kvcache-demo: cannot reach the router at %s\n",
                 absl::GetFlag(FLAGS_router).c_str());
    return 2;
  }
  Demo demo(channel);
  const int users = absl::GetFlag(FLAGS_users);
  if (users < 1 || users > static_cast<int>(kQuestions.size())) {
    std::fprintf(stderr, "kvcache-demo: --users must be 1 to %zu\n", kQuestions.size());
    return 1;
  }
  const int turns = static_cast<int>(kQuestions[0].size());
  const char* names[] = {"alice", "bob", "carol"};
  std::map<std::string, std::vector<std::vector<int32_t>>> replies, twin_replies;
  std::map<std::string, bool> compared;  // every turn of the user and its twin answered
  int64_t prompt = 0, cached = 0, restored = 0, failures = 0;
  const absl::Time start = absl::Now();

  // A run starts from fresh sessions: an earlier run's (on the same router and
  // tenant) would make the forks fail and the twins continue old conversations.
  for (int u = 0; u < users; ++u) {
    demo.Close(names[u]);
    demo.Close(std::string(names[u]) + "-twin");
    compared[names[u]] = true;
  }
  std::printf("\n== workers ==\n");
  demo.PrintWorkers();
  for (int t = 0; t < turns; ++t) {
    std::printf("\n== turn %d of %d ==\n", t + 1, turns);
    for (int u = 0; u < users; ++u) {
      const std::string user = names[u];
      std::printf("  %s: %s\n", user.c_str(), kQuestions[u][t].c_str());
      TurnResult r = demo.Turn(user, t, kQuestions[u][t], /*print=*/true);
      Demo::PrintUsage(user, r);
      std::vector<const TurnResult*> results = {&r};
      TurnResult twin;
      if (t > 0) {
        twin = demo.Turn(user + "-twin", t, kQuestions[u][t], /*print=*/false);
        Demo::PrintUsage(user + "-twin", twin);
        results.push_back(&twin);
        replies[user].push_back(r.tokens);
        twin_replies[user].push_back(twin.tokens);
        if (!r.status.ok() || !twin.status.ok()) compared[user] = false;
      }
      for (const TurnResult* x : results) {
        if (!x->status.ok()) ++failures;
        prompt += x->final.usage().prompt_tokens();
        cached += x->final.usage().cached_tokens();
        restored += x->final.usage().restored_tokens();
      }
    }
    if (t == 0) {
      std::printf("\n== each session forks a twin: it shares the pages and gets the same next turns ==\n");
      for (int u = 0; u < users; ++u) {
        grpc::Status st = demo.Fork(names[u], std::string(names[u]) + "-twin");
        if (!st.ok()) {
          std::printf("    fork of %s failed: %s\n", names[u], st.error_message().c_str());
          ++failures;
        }
      }
    }
    if (t == 1) {
      // Move alice to the other worker between turns; her twin stays.
      const std::string from = demo.WorkerOf("alice");
      std::printf("\n== migration: alice leaves worker %s ==\n", from.c_str());
      v1::MigrateSessionResponse resp;
      grpc::Status st = demo.Migrate("alice", "", &resp);
      if (st.ok()) {
        std::printf("    moved to %s: %lld bytes in %.1f ms (the session paused for %.1f ms)\n",
                    resp.session().worker_id().c_str(), static_cast<long long>(resp.bytes_moved()),
                    resp.total_us() / 1000.0, resp.pause_us() / 1000.0);
      } else {
        std::printf("    migration failed: %s\n", st.error_message().c_str());
        ++failures;
      }
      std::printf("\n== workers after the squeeze and the migration ==\n");
      demo.PrintWorkers();
    }
  }

  std::printf("\n== summary ==\n");
  bool identical = true;
  for (int u = 0; u < users; ++u) {
    const std::string user = names[u];
    const bool same = compared[user] && replies[user] == twin_replies[user];
    identical &= same;
    std::printf("    %-6s replies of turns 2-%d identical to its twin's: %s\n", user.c_str(), turns,
                !compared[user] ? "not compared (a turn failed)"
                : same          ? "yes"
                                : "NO");
  }
  std::printf("    prompt tokens %lld, served from cache %lld (%.0f%%), restored from host RAM %lld\n",
              static_cast<long long>(prompt), static_cast<long long>(cached),
              prompt > 0 ? 100.0 * cached / prompt : 0.0, static_cast<long long>(restored));
  std::printf("    failures %lld, wall time %.1f s\n", static_cast<long long>(failures),
              absl::ToDoubleSeconds(absl::Now() - start));
  demo.PrintWorkers();
  return failures == 0 && identical ? 0 : 1;
}

}  // namespace
}  // namespace kvcache

int main(int argc, char** argv) {
  kvcache::SetFlagsUsage("kvcache-demo --router=HOST:PORT: the scripted multi-user chat of scripts/run.sh");
  absl::ParseCommandLine(argc, argv);
  return kvcache::Run();
}
