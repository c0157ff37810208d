// kvcache-health: a gRPC health check client for container health checks and Kubernetes exec
// probes (the native gRPC probe speaks plaintext only; this one also speaks TLS/mTLS).
//
//   kvcache-health [--addr=127.0.0.1:7070] [--service=liveness] [--timeout_ms=2000]
//                  [--tls_ca=ca.crt [--tls_cert=tls.crt --tls_key=tls.key] [--tls_server_name=N]]
//
// Calls grpc.health.v1.Health/Check and exits 0 when the service reports SERVING, 1 when it
// reports anything else or the call fails, 2 on bad arguments. Built in the images' build stage:
//   c++ -O2 -std=c++17 deploy/docker/health_probe.cc -o kvcache-health $(pkg-config --cflags --libs grpc++)
// It carries no generated code: the two messages are encoded by hand (HealthCheckRequest is
// `string service = 1`, HealthCheckResponse is `ServingStatus status = 1`, SERVING = 1).
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <future>
#include <iostream>
#include <map>
#include <sstream>
#include <string>

namespace {

bool ReadFile(const std::string& path, std::string* out) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  std::ostringstream s;
  s << in.rdbuf();
  *out = s.str();
  return true;
}

int Usage(const std::string& why) {
  std::cerr << "kvcache-health: " << why
            << "\nusage: kvcache-health [--addr=HOST:PORT] [--service=NAME] [--timeout_ms=N]"
               " [--tls_ca=FILE [--tls_cert=FILE --tls_key=FILE] [--tls_server_name=NAME]]\n";
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::map<std::string, std::string> flags = {
      {"addr", "127.0.0.1:7070"}, {"service", "liveness"}, {"timeout_ms", "2000"}, {"tls_ca", ""},
      {"tls_cert", ""},           {"tls_key", ""},         {"tls_server_name", ""}};
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    size_t eq = arg.find('=');
    if (arg.rfind("--", 0) != 0 || eq == std::string::npos) return Usage("bad argument " + arg);
    std::string name = arg.substr(2, eq - 2);
    if (!flags.count(name)) return Usage("unknown flag --" + name);
    flags[name] = arg.substr(eq + 1);
  }
  int timeout_ms = 0;
  try {
    timeout_ms = std::stoi(flags["timeout_ms"]);
  } catch (...) {
    return Usage("bad --timeout_ms");
  }
  if (flags["service"].size() > 127) return Usage("--service too long");

  std::shared_ptr<grpc::ChannelCredentials> creds = grpc::InsecureChannelCredentials();
  grpc::ChannelArguments args;
  if (!flags["tls_ca"].empty()) {
    grpc::SslCredentialsOptions ssl;
    if (!ReadFile(flags["tls_ca"], &ssl.pem_root_certs)) return Usage("cannot read " + flags["tls_ca"]);
    if (!flags["tls_cert"].empty() && (!ReadFile(flags["tls_cert"], &ssl.pem_cert_chain) ||
                                       !ReadFile(flags["tls_key"], &ssl.pem_private_key))) {
      return Usage("cannot read --tls_cert/--tls_key");
    }
    creds = grpc::SslCredentials(ssl);
    if (!flags["tls_server_name"].empty()) {
      args.SetSslTargetNameOverride(flags["tls_server_name"]);
    }
  } else if (!flags["tls_cert"].empty() || !flags["tls_server_name"].empty()) {
    return Usage("--tls_cert and --tls_server_name need --tls_ca");
  }
  auto channel = grpc::CreateCustomChannel(flags["addr"], creds, args);

  // HealthCheckRequest{service}: field 1, wire type 2 (length-delimited).
  const std::string& service = flags["service"];
  std::string request = std::string("\x0a", 1) + static_cast<char>(service.size()) + service;
  grpc::Slice slice(request);
  grpc::ByteBuffer request_buffer(&slice, 1);
  grpc::ByteBuffer response_buffer;

  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(timeout_ms));
  grpc::GenericStub stub(channel);
  std::promise<grpc::Status> done;
  stub.UnaryCall(&context, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request_buffer,
                 &response_buffer, [&done](grpc::Status s) { done.set_value(std::move(s)); });
  grpc::Status status = done.get_future().get();
  if (!status.ok()) {
    std::cerr << "kvcache-health: " << flags["addr"] << " service '" << service
              << "': " << status.error_code() << " " << status.error_message() << "\n";
    return 1;
  }
  std::vector<grpc::Slice> slices;
  std::string response;
  if (response_buffer.Dump(&slices).ok()) {
    for (const auto& s : slices) response.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  // HealthCheckResponse{status}: field 1, varint; absent means UNKNOWN (0).
  int serving_status = (response.size() >= 2 && response[0] == '\x08') ? response[1] : 0;
  static const char* kNames[] = {"UNKNOWN", "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN"};
  const char* name = serving_status >= 0 && serving_status <= 3 ? kNames[serving_status] : "?";
  std::cout << flags["addr"] << " service '" << service << "': " << name << "\n";
  return serving_status == 1 ? 0 : 1;
}
