#include "router/cli/chat.h"

#include <istream>
#include <ostream>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "router/cli/format.h"

namespace kvcache::cli {
namespace {

void AddMessage(v1::ChatMessages* chat, const std::string& role, const std::string& content) {
  v1::ChatMessage* m = chat->add_messages();
  m->set_role(role);
  m->set_content(content);
}

// The session is gone from the server, so its cached context must be resent.
bool SessionLost(const absl::Status& status) {
  return status.code() == absl::StatusCode::kNotFound || status.code() == absl::StatusCode::kUnavailable;
}

}  // namespace

ChatResult RunChat(const ChatOptions& options, const GenerateFn& generate, std::istream& in,
                   std::ostream& out, std::ostream& err) {
  ChatResult result;
  // The conversation so far, as the server should see it on a FULL_CONTEXT turn.
  std::vector<v1::ChatMessage> history;
  if (!options.system_prompt.empty()) {
    v1::ChatMessage system;
    system.set_role("system");
    system.set_content(options.system_prompt);
    history.push_back(system);
  }
  // FULL_CONTEXT until the server holds the session; APPEND afterwards.
  bool server_has_session = options.resume;
  // Tokens of the last reply this client read when that reply was cut (an
  // error or a cancel after tokens): the next APPEND says so (tokens_read), so
  // that the server drops any it sent that never arrived.
  int cut_reply_read = -1;
  const char* dim_on = options.color ? "\033[2m" : "";
  const char* dim_off = options.color ? "\033[0m" : "";

  std::string line;
  while (true) {
    if (options.prompt) err << "> " << std::flush;
    if (!std::getline(in, line)) break;
    const std::string text(absl::StripAsciiWhitespace(line));
    if (text.empty()) continue;
    if (text == "/quit" || text == "/exit") break;

    auto build = [&](bool append) {
      v1::GenerateRequest req;
      req.set_session_id(options.session_id);
      req.set_mode(append ? v1::APPEND : v1::FULL_CONTEXT);
      *req.mutable_sampling() = options.sampling;
      req.set_pin(options.pin);
      v1::ChatMessages* chat = req.mutable_input()->mutable_chat();
      if (!append) {
        for (const auto& m : history) *chat->add_messages() = m;
      } else if (cut_reply_read >= 0) {
        req.set_tokens_read(cut_reply_read);
      }
      AddMessage(chat, "user", text);
      return req;
    };

    std::string reply;
    auto on_token = [&](const v1::GenerateResponse::Token& t) {
      reply += t.text();
      out << t.text() << std::flush;
    };
    bool append = server_has_session;
    int tokens_seen = 0;
    absl::StatusOr<v1::GenerateResponse::Final> final = generate(build(append), on_token, &tokens_seen);
    if (!final.ok() && append && tokens_seen == 0 && SessionLost(final.status()) && !options.resume) {
      err << dim_on << "[session " << options.session_id << " lost (" << final.status().message()
          << "); resending the conversation]" << dim_off << "\n";
      append = false;
      final = generate(build(append), on_token, &tokens_seen);
    }
    if (!reply.empty()) out << "\n" << std::flush;
    auto keep_turn = [&] {
      v1::ChatMessage user;
      user.set_role("user");
      user.set_content(text);
      history.push_back(user);
      v1::ChatMessage assistant;
      assistant.set_role("assistant");
      assistant.set_content(reply);
      history.push_back(assistant);
    };
    if (!final.ok()) {
      if (final.status().code() == absl::StatusCode::kCancelled && tokens_seen > 0) {
        err << dim_on << "[stopped]" << dim_off << "\n";  // "stop generating" (Ctrl-C): not a failure
      } else {
        ++result.failed_turns;
        err << "error: " << absl::StatusCodeToString(final.status().code()) << ": "
            << final.status().message() << "\n";
      }
      if (tokens_seen > 0) {
        // The user saw part of a reply, and the session keeps what was sent
        // (common.proto, GenerateRequest): the conversation goes on from what
        // was read, in the session or, if it is lost, in the resent history.
        ++result.turns;
        keep_turn();
        server_has_session = true;
        cut_reply_read = tokens_seen;
      }
      continue;
    }
    ++result.turns;
    keep_turn();
    server_has_session = true;
    cut_reply_read = -1;
    err << dim_on << StatusLine(*final) << dim_off << "\n" << std::flush;
  }
  return result;
}

}  // namespace kvcache::cli
