// The interactive chat loop of kvcache-cli: reads user lines, sends the first turn
// as FULL_CONTEXT chat messages and later turns as APPEND (only the new user
// message, so the server reuses the session's cached context), streams the reply
// and prints a status line after each turn.
//
// The loop keeps the whole conversation locally, so when an APPEND turn is refused
// before any token because the session is gone (NOT_FOUND, or UNAVAILABLE after
// its worker was lost) it resends the history as one FULL_CONTEXT request.
//
// Thread-safety: RunChat runs on the calling thread; the streams are its own.
#ifndef KVCACHE_ROUTER_CLI_CHAT_H_
#define KVCACHE_ROUTER_CLI_CHAT_H_

#include <functional>
#include <iosfwd>
#include <string>

#include "absl/status/statusor.h"
#include "kvcache/v1/common.pb.h"

namespace kvcache::cli {

struct ChatOptions {
  std::string session_id;     // REQUIRES: non-empty
  std::string system_prompt;  // empty: the model template's default
  v1::SamplingParams sampling;
  bool pin = false;
  // The session already exists on the server: the first turn is APPEND too.
  bool resume = false;
  // Print "> " before reading each line (stdin is a terminal).
  bool prompt = false;
  // Wrap status lines in the ANSI "dim" attribute (stderr is a terminal).
  bool color = false;
};

// One Generate call, as Client::Generate.
using GenerateFn = std::function<absl::StatusOr<v1::GenerateResponse::Final>(
    const v1::GenerateRequest&, const std::function<void(const v1::GenerateResponse::Token&)>&, int*)>;

struct ChatResult {
  int turns = 0;         // turns answered
  int failed_turns = 0;  // turns that ended in an error
};

// Runs until `in` ends or a line reads "/quit" or "/exit"; blank lines are
// skipped. Reply text goes to `out`; prompts, status lines and errors to `err`.
ChatResult RunChat(const ChatOptions& options, const GenerateFn& generate, std::istream& in,
                   std::ostream& out, std::ostream& err);

}  // namespace kvcache::cli

#endif  // KVCACHE_ROUTER_CLI_CHAT_H_
