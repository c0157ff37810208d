#include "router/cli/format.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"

namespace kvcache::cli {
namespace {

std::string Ms(int64_t us) { return absl::StrFormat("%.1f ms", static_cast<double>(us) / 1000.0); }

std::string LastUsed(int64_t unix_ms) {
  if (unix_ms <= 0) return "-";
  return absl::FormatTime("%Y-%m-%d %H:%M:%S", absl::FromUnixMillis(unix_ms), absl::LocalTimeZone());
}

}  // namespace

double DecodeTokensPerSecond(const v1::Usage& usage) {
  const int64_t decode_us = usage.total_time_us() - usage.time_to_first_token_us();
  if (usage.generated_tokens() < 2 || decode_us <= 0) return 0.0;
  return static_cast<double>(usage.generated_tokens() - 1) * 1e6 / static_cast<double>(decode_us);
}

std::string FinishReasonName(v1::FinishReason reason) {
  switch (reason) {
    case v1::FINISH_REASON_STOP:
      return "stop";
    case v1::FINISH_REASON_LENGTH:
      return "length";
    case v1::FINISH_REASON_STOP_STRING:
      return "stop_string";
    case v1::FINISH_REASON_CONTEXT_FULL:
      return "context_full";
    default:
      return "unspecified";
  }
}

std::string SessionStateName(v1::SessionState state) {
  switch (state) {
    case v1::SESSION_IDLE:
      return "idle";
    case v1::SESSION_RUNNING:
      return "running";
    case v1::SESSION_OFFLOADED:
      return "offloaded";
    case v1::SESSION_MIGRATING:
      return "migrating";
    default:
      return "unspecified";
  }
}

std::string StatusLine(const v1::GenerateResponse::Final& final) {
  const v1::Usage& u = final.usage();
  std::vector<std::string> parts;
  parts.push_back(absl::StrCat("worker ", final.worker_id().empty() ? "?" : final.worker_id()));
  std::string cached = absl::StrCat("cached ", u.cached_tokens(), "/", u.prompt_tokens(), " tokens");
  if (u.restored_tokens() > 0) absl::StrAppend(&cached, " (", u.restored_tokens(), " restored)");
  parts.push_back(std::move(cached));
  parts.push_back(absl::StrCat("ttft ", Ms(u.time_to_first_token_us())));
  const double rate = DecodeTokensPerSecond(u);
  if (rate > 0) parts.push_back(absl::StrFormat("%.1f tok/s", rate));
  if (final.finish_reason() != v1::FINISH_REASON_STOP &&
      final.finish_reason() != v1::FINISH_REASON_STOP_STRING) {
    parts.push_back(FinishReasonName(final.finish_reason()));
  }
  return absl::StrCat("[", absl::StrJoin(parts, " | "), "]");
}

std::string UsageSummary(const v1::GenerateResponse::Final& final) {
  const v1::Usage& u = final.usage();
  std::string out;
  absl::StrAppend(&out, "worker: ", final.worker_id(), "\n");
  absl::StrAppend(&out, "session: ", final.session_id().empty() ? "(ephemeral)" : final.session_id(), "\n");
  absl::StrAppend(&out, "finish_reason: ", FinishReasonName(final.finish_reason()), "\n");
  absl::StrAppend(&out, "prompt_tokens: ", u.prompt_tokens(), "\n");
  absl::StrAppend(&out, "cached_tokens: ", u.cached_tokens(), "\n");
  absl::StrAppend(&out, "restored_tokens: ", u.restored_tokens(), "\n");
  absl::StrAppend(&out, "generated_tokens: ", u.generated_tokens(), "\n");
  if (final.predicted_cached_tokens() >= 0) {
    absl::StrAppend(&out, "predicted_cached_tokens: ", final.predicted_cached_tokens(), "\n");
  }
  absl::StrAppend(&out, "time_to_first_token: ", Ms(u.time_to_first_token_us()), "\n");
  absl::StrAppend(&out, "queue_time: ", Ms(u.queue_time_us()), "\n");
  absl::StrAppend(&out, "total_time: ", Ms(u.total_time_us()), "\n");
  absl::StrAppend(&out, absl::StrFormat("decode_rate: %.1f tok/s\n", DecodeTokensPerSecond(u)));
  return out;
}

std::string FormatTable(const std::vector<std::string>& header,
                        const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> width(header.size(), 0);
  auto widen = [&](const std::vector<std::string>& row) {
    for (size_t i = 0; i < row.size() && i < width.size(); ++i) width[i] = std::max(width[i], row[i].size());
  };
  widen(header);
  for (const auto& r : rows) widen(r);
  std::string out;
  auto emit = [&](const std::vector<std::string>& row) {
    std::string line;
    for (size_t i = 0; i < width.size(); ++i) {
      const std::string cell = i < row.size() ? row[i] : "";
      absl::StrAppend(&line, cell);
      if (i + 1 < width.size()) line.append(width[i] - cell.size() + 2, ' ');
    }
    line.erase(line.find_last_not_of(' ') + 1);
    absl::StrAppend(&out, line, "\n");
  };
  emit(header);
  for (const auto& r : rows) emit(r);
  return out;
}

std::string SessionsTable(const v1::ListSessionsResponse& sessions) {
  std::vector<const v1::SessionInfo*> sorted;
  for (const auto& s : sessions.sessions()) sorted.push_back(&s);
  std::sort(sorted.begin(), sorted.end(), [](const v1::SessionInfo* a, const v1::SessionInfo* b) {
    return a->session_id() < b->session_id();
  });
  std::vector<std::vector<std::string>> rows;
  for (const v1::SessionInfo* s : sorted) {
    rows.push_back({s->session_id(), s->tenant().empty() ? "-" : s->tenant(), s->worker_id(),
                    SessionStateName(s->state()), absl::StrCat(s->tokens_cached()),
                    absl::StrCat(s->pages_device()), absl::StrCat(s->pages_host()),
                    absl::StrCat(s->pages_shared()), s->pinned() ? "yes" : "no",
                    LastUsed(s->last_used_unix_ms())});
  }
  return FormatTable({"SESSION", "TENANT", "WORKER", "STATE", "TOKENS", "PAGES_DEV", "PAGES_HOST", "SHARED",
                      "PINNED", "LAST_USED"},
                     rows);
}

std::string SessionDetail(const v1::SessionInfo& s) {
  std::string out;
  absl::StrAppend(&out, "session: ", s.session_id(), "\n");
  absl::StrAppend(&out, "tenant: ", s.tenant().empty() ? "-" : s.tenant(), "\n");
  absl::StrAppend(&out, "worker: ", s.worker_id(), "\n");
  absl::StrAppend(&out, "state: ", SessionStateName(s.state()), "\n");
  absl::StrAppend(&out, "tokens_cached: ", s.tokens_cached(), "\n");
  absl::StrAppend(&out, "pages_device: ", s.pages_device(), "\n");
  absl::StrAppend(&out, "pages_host: ", s.pages_host(), "\n");
  absl::StrAppend(&out, "pages_shared: ", s.pages_shared(), "\n");
  absl::StrAppend(&out, "pinned: ", s.pinned() ? "yes" : "no", "\n");
  absl::StrAppend(&out, "last_used: ", LastUsed(s.last_used_unix_ms()), "\n");
  return out;
}

std::string WorkersTable(const v1::ListWorkersResponse& workers) {
  std::vector<std::vector<std::string>> rows;
  for (const auto& w : workers.workers()) {
    const v1::WorkerLoad& l = w.load();
    if (w.health() == "DOWN") {  // its last report is old news: no load to show
      rows.push_back({w.worker_id(), w.address(), w.health(), absl::StrCat(w.sessions()), "-", "-", "-", "-",
                      "-", "-", w.model_id().empty() ? "-" : w.model_id()});
      continue;
    }
    rows.push_back({w.worker_id(), w.address(), w.health(), absl::StrCat(w.sessions()),
                    absl::StrCat(l.running_requests()), absl::StrCat(l.waiting_requests()),
                    absl::StrCat(l.queued_prefill_tokens()),
                    absl::StrCat(l.pages_free_device(), "/", l.pages_total_device()),
                    absl::StrCat(l.pages_free_host(), "/", l.pages_total_host()),
                    absl::StrFormat("%.1f", l.decode_tokens_per_second()),
                    w.model_id().empty() ? "-" : w.model_id()});
  }
  return FormatTable({"WORKER", "ADDRESS", "HEALTH", "SESSIONS", "RUNNING", "WAITING", "PREFILL_Q",
                      "DEV_FREE/TOTAL", "HOST_FREE/TOTAL", "DECODE_TOK/S", "MODEL"},
                     rows);
}

}  // namespace kvcache::cli
