// Benchmark report convention shared by every benchmark binary.
//
// Every benchmark accepts `--json PATH` and writes
//   {"benchmark": name, "metrics": {...}, "baseline": {...}, "ratio": {...}, "machine": {...}}
// Any baseline a ratio compares against is measured in the same run. Every ratio
// is oriented so that larger is better for kvcache (baseline time / our time, our
// throughput / baseline throughput).
//
// Thread-safety: BenchReport is a plain value; not safe for concurrent mutation.
#ifndef KVCACHE_COMMON_BENCH_JSON_H_
#define KVCACHE_COMMON_BENCH_JSON_H_

#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace kvcache::bench {

struct BenchReport {
  std::string benchmark;                     // file stem: writes <benchmark>.json
  std::map<std::string, double> metrics;     // raw figures, units in the key (e.g. _ms, _per_s)
  std::map<std::string, double> baseline;    // what the ratios compare against
  std::map<std::string, double> ratio;       // larger is better
  std::map<std::string, std::string> notes;  // free text (e.g. what the baseline is)
};

// Facts about the machine: hostname, logical cpus, cpu model, compiler, build type.
std::map<std::string, std::string> MachineInfo();

// Serialises the report (with MachineInfo) as JSON text.
std::string ToJson(const BenchReport& report);

// Prints a human-readable table to stdout and, when --json was given, writes the
// JSON file there. Returns the error if the file cannot be written.
absl::Status Finish(const BenchReport& report);

// The value of --json ("" when not given).
std::string JsonPath();

// The median of repeated measurements: the middle sample, the upper of the two
// middle ones for an even count; 0 for none.
double Median(std::vector<double> samples);

// How far repeated measurements spread: (max - min) / median; 0 for none.
double Spread(const std::vector<double>& samples);

}  // namespace kvcache::bench

#endif  // KVCACHE_COMMON_BENCH_JSON_H_
