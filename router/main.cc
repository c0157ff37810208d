// kvcache-router: the front door. Until the router lands (issue: router) the
// binary brings up the process scaffolding only: gRPC with health and
// reflection, /metrics, graceful shutdown; KvCache RPCs answer UNIMPLEMENTED.
#include "common/init.h"
#include "common/server.h"
#include "kvcache/v1/router.grpc.pb.h"

int main(int argc, char** argv) {
  const std::string name = "kvcache-router";
  kvcache::InitProcess(argc, argv, name, "kvcache-router: routes sessions to workers by cache affinity.");
  auto options = kvcache::ServerOptionsFromFlags(name);
  if (!options.ok()) kvcache::DieWith(name, options.status());
  auto process = kvcache::ServerProcess::Init(*options);
  if (!process.ok()) kvcache::DieWith(name, process.status(), 1);
  kvcache::v1::KvCache::CallbackService api;
  kvcache::v1::KvCacheAdmin::CallbackService admin;
  absl::Status served = (*process)->Serve({&api, &admin});
  if (!served.ok()) kvcache::DieWith(name, served, 1);
  return 0;
}
