#include "common/bench_json.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <fstream>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"

ABSL_FLAG(std::string, json, "", "Write the benchmark report as JSON to this path");

namespace kvcache::bench {
namespace {

std::string Escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          out += absl::StrFormat("\\u%04x", c);
        } else {
          out += c;
        }
    }
  }
  return out;
}

std::string Number(double v) {
  if (!std::isfinite(v)) return "null";  // JSON has no NaN/Inf
  return absl::StrFormat("%.6g", v);
}

std::string NumberMap(const std::map<std::string, double>& m) {
  std::vector<std::string> parts;
  for (const auto& [k, v] : m) parts.push_back(absl::StrCat("\"", Escape(k), "\": ", Number(v)));
  return absl::StrCat("{", absl::StrJoin(parts, ", "), "}");
}

std::string StringMap(const std::map<std::string, std::string>& m) {
  std::vector<std::string> parts;
  for (const auto& [k, v] : m) {
    parts.push_back(absl::StrCat("\"", Escape(k), "\": \"", Escape(v), "\""));
  }
  return absl::StrCat("{", absl::StrJoin(parts, ", "), "}");
}

std::string CpuModel() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (absl::StartsWith(line, "model name")) {
      auto pos = line.find(':');
      if (pos != std::string::npos) return std::string(absl::StripAsciiWhitespace(line.substr(pos + 1)));
    }
  }
  return "unknown";
}

}  // namespace

std::map<std::string, std::string> MachineInfo() {
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  std::map<std::string, std::string> info;
  info["hostname"] = host;
  info["logical_cpus"] = absl::StrCat(std::thread::hardware_concurrency());
  info["cpu_model"] = CpuModel();
#if defined(__clang__)
  info["compiler"] = absl::StrCat("clang ", __clang_major__, ".", __clang_minor__);
#elif defined(__GNUC__)
  info["compiler"] = absl::StrCat("gcc ", __GNUC__, ".", __GNUC_MINOR__);
#endif
#ifdef NDEBUG
  info["build"] = "release";
#else
  info["build"] = "debug";
#endif
  return info;
}

std::string ToJson(const BenchReport& r) {
  return absl::StrCat(
      "{\n  \"benchmark\": \"", Escape(r.benchmark), "\",\n  \"metrics\": ", NumberMap(r.metrics),
      ",\n  \"baseline\": ", NumberMap(r.baseline), ",\n  \"ratio\": ", NumberMap(r.ratio),
      ",\n  \"notes\": ", StringMap(r.notes), ",\n  \"machine\": ", StringMap(MachineInfo()), "\n}\n");
}

std::string JsonPath() { return absl::GetFlag(FLAGS_json); }

absl::Status Finish(const BenchReport& r) {
  std::printf("== benchmark %s ==\n", r.benchmark.c_str());
  auto print = [](const char* section, const std::map<std::string, double>& m) {
    for (const auto& [k, v] : m) std::printf("  %-9s %-40s %14.6g\n", section, k.c_str(), v);
  };
  print("metric", r.metrics);
  print("baseline", r.baseline);
  print("ratio", r.ratio);
  for (const auto& [k, v] : r.notes) std::printf("  note      %-40s %s\n", k.c_str(), v.c_str());
  std::fflush(stdout);
  const std::string path = JsonPath();
  if (path.empty()) return absl::OkStatus();
  std::ofstream out(path);
  if (!out) return absl::UnavailableError(absl::StrCat("cannot write ", path));
  out << ToJson(r);
  if (!out.good()) return absl::DataLossError(absl::StrCat("short write to ", path));
  std::printf("  wrote %s\n", path.c_str());
  return absl::OkStatus();
}

double Median(std::vector<double> samples) {
  if (samples.empty()) return 0;
  const auto mid = samples.begin() + static_cast<std::ptrdiff_t>(samples.size() / 2);
  std::nth_element(samples.begin(), mid, samples.end());
  return *mid;
}

double Spread(const std::vector<double>& samples) {
  const double median = Median(samples);
  if (median == 0) return 0;
  const auto [lo, hi] = std::minmax_element(samples.begin(), samples.end());
  return (*hi - *lo) / median;
}

}  // namespace kvcache::bench
