// Text that kvcache-cli prints: per-turn status lines, usage summaries and tables
// of sessions and workers.
//
// Thread-safety: pure functions.
#ifndef KVCACHE_ROUTER_CLI_FORMAT_H_
#define KVCACHE_ROUTER_CLI_FORMAT_H_

#include <string>
#include <vector>

#include "kvcache/v1/router.pb.h"

namespace kvcache::cli {

// Decode rate of a request: tokens after the first over the time after the first,
// tokens_per_s = (generated_tokens - 1) / (total_time_us - time_to_first_token_us) * 1e6.
// 0 when fewer than two tokens were generated or no time passed.
double DecodeTokensPerSecond(const v1::Usage& usage);

// One line after a chat turn, e.g.
//   [worker w1 | cached 120/150 tokens | ttft 35.2 ms | 41.3 tok/s]
// plus "restored N" when tokens came back from tier 1 and the finish reason
// when generation did not stop by itself.
std::string StatusLine(const v1::GenerateResponse::Final& final);

// Every usage field, one "key: value" per line (the generate subcommand).
std::string UsageSummary(const v1::GenerateResponse::Final& final);

// "stop", "length", "stop_string", "context_full" or "unspecified".
std::string FinishReasonName(v1::FinishReason reason);
// "idle", "running", "offloaded", "migrating" or "unspecified".
std::string SessionStateName(v1::SessionState state);

// Columns padded to their widest cell, two spaces apart; no trailing spaces.
std::string FormatTable(const std::vector<std::string>& header,
                        const std::vector<std::vector<std::string>>& rows);

// A table of sessions, one row each, sorted by session id.
std::string SessionsTable(const v1::ListSessionsResponse& sessions);
// Every field of one session, "key: value" per line.
std::string SessionDetail(const v1::SessionInfo& session);
// A table of workers with their load, one row each, in the router's order.
std::string WorkersTable(const v1::ListWorkersResponse& workers);

}  // namespace kvcache::cli

#endif  // KVCACHE_ROUTER_CLI_FORMAT_H_
