// Process-wide logging on spdlog.
//
// Binaries call InitLogging once from main, after flags are parsed; libraries log
// through the KV_LOG_* macros. Thread-safety: spdlog loggers are thread-safe.
#ifndef KVCACHE_COMMON_LOGGING_H_
#define KVCACHE_COMMON_LOGGING_H_

#include <string>

#include "spdlog/spdlog.h"

namespace kvcache {

// Sets the default logger: stderr, "[time] [level] [name] message", and the level
// from --log_level (trace, debug, info, warn, error, off).
void InitLogging(const std::string& process_name);

}  // namespace kvcache

#define KV_LOG_DEBUG(...) SPDLOG_DEBUG(__VA_ARGS__)
#define KV_LOG_INFO(...) SPDLOG_INFO(__VA_ARGS__)
#define KV_LOG_WARN(...) SPDLOG_WARN(__VA_ARGS__)
#define KV_LOG_ERROR(...) SPDLOG_ERROR(__VA_ARGS__)

#endif  // KVCACHE_COMMON_LOGGING_H_
