#include "router/cli/client.h"

#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/peer_auth.h"
#include "common/status.h"

namespace kvcache::cli {
namespace {

absl::StatusOr<std::string> ReadFile(const std::string& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat("cannot read ", what, " file ", path));
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> Credentials(const ClientOptions& o) {
  if (o.tls_ca_file.empty()) {
    if (!o.tls_cert_file.empty() || !o.tls_key_file.empty()) {
      return absl::InvalidArgumentError("--tls_cert/--tls_key need --tls_ca");
    }
    return grpc::InsecureChannelCredentials();
  }
  grpc::SslCredentialsOptions ssl;
  auto ca = ReadFile(o.tls_ca_file, "--tls_ca");
  if (!ca.ok()) return ca.status();
  ssl.pem_root_certs = *ca;
  if (o.tls_cert_file.empty() != o.tls_key_file.empty()) {
    return absl::InvalidArgumentError("--tls_cert and --tls_key go together");
  }
  if (!o.tls_cert_file.empty()) {
    auto cert = ReadFile(o.tls_cert_file, "--tls_cert");
    if (!cert.ok()) return cert.status();
    auto key = ReadFile(o.tls_key_file, "--tls_key");
    if (!key.ok()) return key.status();
    ssl.pem_cert_chain = *cert;
    ssl.pem_private_key = *key;
  }
  return grpc::SslCredentials(ssl);
}

}  // namespace

const char* TargetName(Target target) { return target == Target::kRouter ? "router" : "worker"; }

absl::StatusOr<Target> ParseTarget(const std::string& name) {
  if (name == "router") return Target::kRouter;
  if (name == "worker") return Target::kWorker;
  return absl::InvalidArgumentError(absl::StrCat("--target must be router or worker, not '", name, "'"));
}

absl::StatusOr<ClientPtr> Client::Connect(const ClientOptions& options) {
  auto creds = Credentials(options);
  if (!creds.ok()) return creds.status();
  grpc::ChannelArguments args;
  if (!options.tls_server_name.empty()) args.SetSslTargetNameOverride(options.tls_server_name);
  // A token goes with every call: a client token to a router, the cluster token
  // to a worker.
  auto channel = options.token.empty() ? grpc::CreateCustomChannel(options.address, *creds, args)
                                       : NewBearerChannel(options.address, *creds, options.token, args);
  // Waiting here turns "nothing listens there" into one clear error instead of a
  // call that fails later (or waits out its whole deadline).
  if (!channel->WaitForConnected(absl::ToChronoTime(absl::Now() + options.connect_timeout))) {
    return absl::UnavailableError(absl::StrCat("cannot reach ", TargetName(options.target), " at ",
                                               options.address, " (no connection within ",
                                               absl::FormatDuration(options.connect_timeout), ")"));
  }
  return ClientPtr(new Client(options, std::move(channel)));
}

Client::Client(ClientOptions options, std::shared_ptr<grpc::Channel> channel)
    : options_(std::move(options)), channel_(std::move(channel)) {
  if (options_.target == Target::kRouter) {
    router_ = v1::KvCache::NewStub(channel_);
    admin_ = v1::KvCacheAdmin::NewStub(channel_);
  } else {
    worker_ = v1::Worker::NewStub(channel_);
  }
}

void Client::Prepare(grpc::ClientContext* ctx) const {
  ctx->set_deadline(absl::ToChronoTime(absl::Now() + options_.timeout));
}

absl::StatusOr<v1::GenerateResponse::Final> Client::Generate(
    const v1::GenerateRequest& request,
    const std::function<void(const v1::GenerateResponse::Token&)>& on_token, int* tokens_seen) {
  grpc::ClientContext ctx;
  Prepare(&ctx);
  {
    absl::MutexLock lock(&mu_);
    generating_ = &ctx;
  }
  auto reader = router_ != nullptr ? router_->Generate(&ctx, request) : worker_->Generate(&ctx, request);
  v1::GenerateResponse msg;
  v1::GenerateResponse::Final final;
  bool have_final = false;
  int seen = 0;
  while (reader->Read(&msg)) {
    if (msg.has_token()) {
      ++seen;
      if (tokens_seen != nullptr) *tokens_seen = seen;
      on_token(msg.token());
    } else if (msg.has_final()) {
      final = msg.final();
      have_final = true;
    }
  }
  absl::Status st = FromGrpcStatus(reader->Finish());
  {
    absl::MutexLock lock(&mu_);
    generating_ = nullptr;
  }
  if (!st.ok()) return st;
  if (!have_final) return absl::InternalError("the stream ended without a final message");
  return final;
}

bool Client::CancelGenerate() {
  absl::MutexLock lock(&mu_);
  if (generating_ == nullptr) return false;
  generating_->TryCancel();
  return true;
}

absl::StatusOr<v1::SessionInfo> Client::GetSession(const std::string& session_id) {
  grpc::ClientContext ctx;
  Prepare(&ctx);
  v1::SessionRequest req;
  req.set_session_id(session_id);
  v1::SessionInfo resp;
  grpc::Status st =
      router_ != nullptr ? router_->GetSession(&ctx, req, &resp) : worker_->GetSession(&ctx, req, &resp);
  if (!st.ok()) return FromGrpcStatus(st);
  return resp;
}

absl::StatusOr<v1::ListSessionsResponse> Client::ListSessions() {
  grpc::ClientContext ctx;
  Prepare(&ctx);
  v1::ListSessionsRequest req;
  v1::ListSessionsResponse resp;
  grpc::Status st =
      router_ != nullptr ? router_->ListSessions(&ctx, req, &resp) : worker_->ListSessions(&ctx, req, &resp);
  if (!st.ok()) return FromGrpcStatus(st);
  return resp;
}

absl::StatusOr<v1::CloseSessionResponse> Client::CloseSession(const std::string& session_id) {
  grpc::ClientContext ctx;
  Prepare(&ctx);
  v1::SessionRequest req;
  req.set_session_id(session_id);
  v1::CloseSessionResponse resp;
  grpc::Status st =
      router_ != nullptr ? router_->CloseSession(&ctx, req, &resp) : worker_->CloseSession(&ctx, req, &resp);
  if (!st.ok()) return FromGrpcStatus(st);
  return resp;
}

absl::StatusOr<v1::ListWorkersResponse> Client::ListWorkers() {
  if (admin_ == nullptr) return absl::FailedPreconditionError("listing workers needs --target=router");
  grpc::ClientContext ctx;
  Prepare(&ctx);
  v1::ListWorkersResponse resp;
  grpc::Status st = admin_->ListWorkers(&ctx, v1::ListWorkersRequest(), &resp);
  if (!st.ok()) return FromGrpcStatus(st);
  return resp;
}

absl::StatusOr<v1::MigrateSessionResponse> Client::MigrateSession(const std::string& session_id,
                                                                  const std::string& to) {
  grpc::ClientContext ctx;
  Prepare(&ctx);
  v1::MigrateSessionResponse resp;
  grpc::Status st;
  if (admin_ != nullptr) {
    v1::AdminMigrateRequest req;
    req.set_session_id(session_id);
    req.set_target_worker(to);
    st = admin_->MigrateSession(&ctx, req, &resp);
  } else {
    if (to.empty())
      return absl::InvalidArgumentError(
          "--to=HOST:PORT (the target worker) is required with --target=worker");
    v1::MigrateSessionRequest req;
    req.set_session_id(session_id);
    req.set_target_address(to);
    st = worker_->MigrateSession(&ctx, req, &resp);
  }
  if (!st.ok()) return FromGrpcStatus(st);
  return resp;
}

absl::StatusOr<v1::DrainResponse> Client::Drain(const std::string& worker, int32_t deadline_ms) {
  grpc::ClientContext ctx;
  Prepare(&ctx);
  v1::DrainResponse resp;
  grpc::Status st;
  if (admin_ != nullptr) {
    v1::DrainWorkerRequest req;
    req.set_worker(worker);
    req.set_deadline_ms(deadline_ms);
    st = admin_->DrainWorker(&ctx, req, &resp);
  } else {
    if (!worker.empty() && worker != options_.address) {
      return absl::InvalidArgumentError(absl::StrCat("with --target=worker, drain drains ", options_.address,
                                                     " itself; drop --worker or use --target=router"));
    }
    v1::DrainRequest req;
    req.set_deadline_ms(deadline_ms);
    st = worker_->Drain(&ctx, req, &resp);
  }
  if (!st.ok()) return FromGrpcStatus(st);
  return resp;
}

}  // namespace kvcache::cli
