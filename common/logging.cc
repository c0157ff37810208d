#include "common/logging.h"

#include <cstdio>
#include <cstdlib>

#include "absl/flags/flag.h"
#include "spdlog/sinks/stdout_color_sinks.h"

ABSL_FLAG(std::string, log_level, "info", "Log level: trace, debug, info, warn, error, off");

namespace kvcache {

void InitLogging(const std::string& process_name) {
  auto logger = spdlog::stderr_color_mt(process_name);
  logger->set_pattern("[%Y-%m-%d %H:%M:%S.%e] [%^%l%$] [%n] %v");
  const std::string level = absl::GetFlag(FLAGS_log_level);
  auto parsed = spdlog::level::from_str(level);
  if (parsed == spdlog::level::off && level != "off") {
    std::fprintf(stderr, "%s: unknown --log_level '%s' (trace, debug, info, warn, error, off)\n",
                 process_name.c_str(), level.c_str());
    std::exit(2);
  }
  logger->set_level(parsed);
  spdlog::set_default_logger(logger);
}

}  // namespace kvcache
