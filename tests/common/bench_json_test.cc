#include "common/bench_json.h"

#include "gtest/gtest.h"

namespace kvcache::bench {
namespace {

TEST(BenchJsonTest, HasEverySectionAndEscapes) {
  BenchReport r;
  r.benchmark = "demo";
  r.metrics["tokens_per_s"] = 12.5;
  r.baseline["memcpy_gbps"] = 10;
  r.ratio["speedup"] = 2;
  r.notes["what"] = "a \"quoted\" note";
  const std::string j = ToJson(r);
  EXPECT_NE(j.find("\"benchmark\": \"demo\""), std::string::npos) << j;
  EXPECT_NE(j.find("\"metrics\": {\"tokens_per_s\": 12.5}"), std::string::npos) << j;
  EXPECT_NE(j.find("\"baseline\": {\"memcpy_gbps\": 10}"), std::string::npos) << j;
  EXPECT_NE(j.find("\"ratio\": {\"speedup\": 2}"), std::string::npos) << j;
  EXPECT_NE(j.find("a \\\"quoted\\\" note"), std::string::npos) << j;
  EXPECT_NE(j.find("\"machine\": {"), std::string::npos) << j;
  EXPECT_NE(j.find("\"logical_cpus\""), std::string::npos) << j;
}

TEST(BenchJsonTest, NonFiniteBecomesNull) {
  BenchReport r;
  r.benchmark = "x";
  r.metrics["nan"] = 0.0 / 0.0;
  EXPECT_NE(ToJson(r).find("\"nan\": null"), std::string::npos);
}

}  // namespace
}  // namespace kvcache::bench
