// Worker discovery's DNS lookups against a real DNS server on loopback (the
// test harness's), and the parsing of --worker_dns names.
#include "router/dns_resolver.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/dns_server.h"

namespace kvcache::router {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(DnsTargetTest, ParsesBothForms) {
  auto system = ParseDnsTarget("kvcache-worker.kvcache.svc:7070");
  ASSERT_TRUE(system.ok()) << system.status();
  EXPECT_EQ(system->server, "");
  EXPECT_EQ(system->name, "kvcache-worker.kvcache.svc");
  EXPECT_EQ(system->port, "7070");
  auto direct = ParseDnsTarget("dns://127.0.0.1:5353/workers.test:7070");
  ASSERT_TRUE(direct.ok()) << direct.status();
  EXPECT_EQ(direct->server, "127.0.0.1:5353");
  EXPECT_EQ(direct->name, "workers.test");
  EXPECT_EQ(direct->port, "7070");
  EXPECT_EQ(direct->spec, "dns://127.0.0.1:5353/workers.test:7070");
}

TEST(DnsTargetTest, RefusesMalformedNames) {
  for (const char* bad : {"workers", "workers:", ":7070", "workers:0", "workers:70000", "workers:http",
                          "dns://127.0.0.1:53", "dns:///workers:7070", "http://workers:7070"}) {
    auto t = ParseDnsTarget(bad);
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(t.status().message(), HasSubstr(bad)) << "the error names what was given";
  }
}

TEST(DnsResolveTest, AnswersEmptyAnswersAndFailures) {
  auto server = testing::DnsServer::Start();
  ASSERT_TRUE(server.ok()) << server.status();
  auto& dns = **server;
  dns.SetAddresses("workers.test", {"127.0.0.3", "127.0.0.2"});
  auto target = ParseDnsTarget("dns://" + dns.address() + "/workers.test:7070");
  ASSERT_TRUE(target.ok());

  DnsAnswer ok = Resolve(*target, absl::Seconds(1));
  EXPECT_EQ(ok.result, DnsAnswer::Result::kOk) << ok.error;
  EXPECT_THAT(ok.addresses, ElementsAre("127.0.0.2:7070", "127.0.0.3:7070"));  // sorted

  // A name the server does not know, and a server that answers with no record:
  // empty answers, not failures.
  auto unknown = ParseDnsTarget("dns://" + dns.address() + "/nobody.test:7070");
  EXPECT_EQ(Resolve(*unknown, absl::Seconds(1)).result, DnsAnswer::Result::kEmpty);
  dns.SetMode(testing::DnsServer::Mode::kEmpty);
  EXPECT_EQ(Resolve(*target, absl::Seconds(1)).result, DnsAnswer::Result::kEmpty);

  dns.SetMode(testing::DnsServer::Mode::kServFail);
  DnsAnswer failed = Resolve(*target, absl::Seconds(1));
  EXPECT_EQ(failed.result, DnsAnswer::Result::kFailed);
  EXPECT_THAT(failed.error, HasSubstr(dns.address()));

  // A server that never answers: a failure within the timeout's retries.
  dns.SetMode(testing::DnsServer::Mode::kSilent);
  const absl::Time start = absl::Now();
  EXPECT_EQ(Resolve(*target, absl::Seconds(1)).result, DnsAnswer::Result::kFailed);
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));

  dns.SetMode(testing::DnsServer::Mode::kAnswer);
  EXPECT_EQ(Resolve(*target, absl::Seconds(1)).addresses.size(), 2u);
  EXPECT_STREQ(DnsResultName(DnsAnswer::Result::kEmpty), "empty");
}

TEST(DnsResolveTest, SystemResolverFindsLocalhost) {
  auto target = ParseDnsTarget("localhost:7070");
  ASSERT_TRUE(target.ok());
  DnsAnswer a = Resolve(*target);
  ASSERT_EQ(a.result, DnsAnswer::Result::kOk) << a.error;
  EXPECT_THAT(a.addresses, ::testing::Contains(::testing::AnyOf("127.0.0.1:7070", "[::1]:7070")));
}

}  // namespace
}  // namespace kvcache::router
