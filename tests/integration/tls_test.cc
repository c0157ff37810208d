// TLS on real processes over loopback: a CA, a server and a client
// certificate made with the openssl CLI at test time; a worker that requires
// client certificates (mutual TLS), and a router that talks mutual TLS to it
// and serves its own clients over TLS. Worker-to-worker migration is not
// exercised: the worker's outgoing calls do not take TLS flags yet.
//
// tests/testing/child_process.h's ServerUnderTest waits for health over a
// plaintext channel, so the processes here are started with ChildProcess and
// waited for over TLS channels made in this file.
#include <sys/wait.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/gguf/tiny_llama.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvcache/v1/router.grpc.pb.h"
#include "kvcache/v1/worker.grpc.pb.h"
#include "tests/testing/child_process.h"
#include "tests/testing/generate_client.h"

namespace kvcache {
namespace {

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Runs `script` with /bin/sh; true when it exits 0 within a minute.
bool RunShell(const std::string& script) {
  auto p = testing::ChildProcess::Start({"/bin/sh", "-c", script});
  if (!p.ok()) return false;
  auto status = (*p)->Wait(absl::Seconds(60));
  return status.ok() && WIFEXITED(*status) && WEXITSTATUS(*status) == 0;
}

// A server started with ChildProcess and ready over TLS.
struct TlsServer {
  std::unique_ptr<testing::ChildProcess> process;
  std::string address;
};

// Starts `binary` on port 0 with `args`, reads its "listening grpc=" line and
// waits until readiness is SERVING over `channel_for(address)`.
absl::StatusOr<TlsServer> StartTlsServer(
    const std::string& binary, std::vector<std::string> args,
    const std::function<std::shared_ptr<grpc::Channel>(const std::string&)>& channel_for) {
  std::vector<std::string> argv = {binary, "--listen=127.0.0.1:0", "--metrics_listen=127.0.0.1:0"};
  argv.insert(argv.end(), args.begin(), args.end());
  auto p = testing::ChildProcess::Start(argv);
  if (!p.ok()) return p.status();
  TlsServer s;
  s.process = std::move(*p);
  auto line = s.process->WaitForLine(" listening grpc=", absl::Seconds(60));
  if (!line.ok()) return line.status();
  for (absl::string_view field : absl::StrSplit(*line, ' ')) {
    if (absl::ConsumePrefix(&field, "grpc=")) s.address = std::string(field);
  }
  if (s.address.empty()) return absl::InternalError(absl::StrCat("no grpc address in: ", *line));
  absl::Status ready = testing::WaitForServing(channel_for(s.address), "readiness", absl::Seconds(60));
  if (!ready.ok()) return ready;
  return s;
}

using testing::Reply;

template <typename Stub>
Reply Generate(Stub* stub, const std::string& text) {
  return testing::Generate(stub, testing::TextRequest("", text, 4), absl::Seconds(10));
}

class TlsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(::testing::TempDir() + "/kvcache_tls_test");
    const std::string& d = *dir_;
    // One CA; a server certificate for 127.0.0.1 and localhost; a client
    // certificate. Both leaf certificates are signed by the CA.
    const std::string script = absl::StrCat(
        "set -e; rm -rf ", d, "; mkdir -p ", d, "; cd ", d, "\n",
        "openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=kvcache-test-ca "
        "-keyout ca.key -out ca.crt\n",
        "printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\\n' > server.ext\n",
        "openssl req -newkey rsa:2048 -nodes -subj /CN=localhost -keyout server.key -out server.csr\n",
        "openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 2 "
        "-extfile server.ext -out server.crt\n",
        "openssl req -newkey rsa:2048 -nodes -subj /CN=kvcache-test-client -keyout client.key -out "
        "client.csr\n",
        "openssl x509 -req -in client.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 2 -out "
        "client.crt\n");
    ASSERT_TRUE(RunShell("(" + script + ") > /dev/null 2>&1")) << "openssl failed:\n" << script;
    model_ = new std::string(d + "/tiny.gguf");
    gguf::TinyLlamaOptions o;
    o.n_ctx = 512;
    ASSERT_TRUE(gguf::WriteTinyLlama(o, *model_).ok());
  }
  static void TearDownTestSuite() {
    RunShell("rm -rf " + *dir_);
    delete dir_;
    delete model_;
  }

  static std::string Path(const std::string& name) { return *dir_ + "/" + name; }

  // TLS channel credentials trusting the test CA, with the client certificate
  // when `with_client_cert`.
  static std::shared_ptr<grpc::ChannelCredentials> Credentials(bool with_client_cert) {
    grpc::SslCredentialsOptions o;
    o.pem_root_certs = ReadFile(Path("ca.crt"));
    if (with_client_cert) {
      o.pem_cert_chain = ReadFile(Path("client.crt"));
      o.pem_private_key = ReadFile(Path("client.key"));
    }
    return grpc::SslCredentials(o);
  }

  // A worker requiring client certificates, and a router in front of it using
  // mutual TLS to it and TLS (server certificate only) to its own clients.
  void StartWorkerAndRouter() {
    auto w = StartTlsServer(
        testing::BinaryPath("worker/kvcache-worker"),
        {"--model=" + *model_, "--worker_id=w0", "--threads=1", "--load_report_interval=100ms",
         "--tier0_bytes=" + std::to_string(16 << 20), "--tier1_bytes=" + std::to_string(16 << 20),
         "--tls_cert=" + Path("server.crt"), "--tls_key=" + Path("server.key"),
         "--tls_client_ca=" + Path("ca.crt")},
        [](const std::string& a) { return grpc::CreateChannel(a, Credentials(/*with_client_cert=*/true)); });
    ASSERT_TRUE(w.ok()) << w.status();
    worker_ = std::move(*w);
    auto r = StartTlsServer(
        testing::BinaryPath("router/kvcache-router"),
        {"--workers=" + worker_.address, "--model=" + *model_, "--health_timeout=2s",
         "--rebalance_interval=0s", "--min_ready_workers=1", "--allow_unauthenticated",
         "--worker_tls_ca=" + Path("ca.crt"), "--worker_tls_cert=" + Path("client.crt"),
         "--worker_tls_key=" + Path("client.key"), "--tls_cert=" + Path("server.crt"),
         "--tls_key=" + Path("server.key")},
        [](const std::string& a) { return grpc::CreateChannel(a, Credentials(/*with_client_cert=*/false)); });
    // Readiness needs the worker healthy: the router's mutual TLS to it works.
    ASSERT_TRUE(r.ok()) << r.status();
    router_ = std::move(*r);
  }

  static std::string* dir_;
  static std::string* model_;
  TlsServer worker_;
  TlsServer router_;
};

std::string* TlsTest::dir_ = nullptr;
std::string* TlsTest::model_ = nullptr;

// A client that trusts the CA gets through the router (which reached the
// worker over mutual TLS) and gets tokens.
TEST_F(TlsTest, ClientWithTheCaGetsThroughTheRouter) {
  StartWorkerAndRouter();
  auto stub = v1::KvCache::NewStub(grpc::CreateChannel(router_.address, Credentials(false)));
  Reply r = Generate(stub.get(), "hello over TLS");
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.tokens.size(), 4u);
  EXPECT_EQ(r.final.worker_id(), "w0");
}

// A plaintext client, and a TLS client that does not trust the test CA, cannot
// talk to the router: UNAVAILABLE, no tokens.
TEST_F(TlsTest, PlaintextAndUntrustingClientsAreRefusedByTheRouter) {
  StartWorkerAndRouter();
  auto plain = v1::KvCache::NewStub(grpc::CreateChannel(router_.address, grpc::InsecureChannelCredentials()));
  Reply r = Generate(plain.get(), "hello in the clear");
  EXPECT_EQ(r.status.error_code(), grpc::UNAVAILABLE) << r.status.error_message();
  EXPECT_TRUE(r.tokens.empty());
  // Empty root certificates: the system's roots, which do not include the test CA.
  auto untrusting = v1::KvCache::NewStub(
      grpc::CreateChannel(router_.address, grpc::SslCredentials(grpc::SslCredentialsOptions())));
  Reply u = Generate(untrusting.get(), "hello, stranger");
  EXPECT_EQ(u.status.error_code(), grpc::UNAVAILABLE) << u.status.error_message();
  EXPECT_TRUE(u.tokens.empty());
  // The router is unharmed.
  auto good = v1::KvCache::NewStub(grpc::CreateChannel(router_.address, Credentials(false)));
  EXPECT_TRUE(Generate(good.get(), "still there?").status.ok());
}

// The worker requires a client certificate: a client with only the CA (no
// certificate) and a plaintext client are refused (UNAVAILABLE); a client with
// the certificate is served.
TEST_F(TlsTest, WorkerRefusesClientsWithoutACertificate) {
  StartWorkerAndRouter();
  auto no_cert =
      v1::Worker::NewStub(grpc::CreateChannel(worker_.address, Credentials(/*with_client_cert=*/false)));
  Reply r = Generate(no_cert.get(), "let me in");
  EXPECT_EQ(r.status.error_code(), grpc::UNAVAILABLE) << r.status.error_message();
  EXPECT_TRUE(r.tokens.empty());
  auto plain = v1::Worker::NewStub(grpc::CreateChannel(worker_.address, grpc::InsecureChannelCredentials()));
  Reply p = Generate(plain.get(), "let me in");
  EXPECT_EQ(p.status.error_code(), grpc::UNAVAILABLE) << p.status.error_message();
  EXPECT_TRUE(p.tokens.empty());
  auto with_cert =
      v1::Worker::NewStub(grpc::CreateChannel(worker_.address, Credentials(/*with_client_cert=*/true)));
  Reply ok = Generate(with_cert.get(), "let me in");
  ASSERT_TRUE(ok.status.ok()) << ok.status.error_message();
  EXPECT_EQ(ok.tokens.size(), 4u);
}

}  // namespace
}  // namespace kvcache
