// kvcache-worker: serves one model on one backend and keeps every session's KV
// cache in pages. Until the worker service lands (issue: worker service) the
// binary brings up the process scaffolding only: gRPC with health and
// reflection, /metrics, graceful shutdown; Worker RPCs answer UNIMPLEMENTED.
#include <cstdio>

#include "absl/flags/flag.h"
#include "common/init.h"
#include "common/logging.h"
#include "common/server.h"
#include "kvcache/v1/worker.grpc.pb.h"

ABSL_FLAG(std::string, worker_id, "", "Name of this worker in logs, metrics and routing (default: host:port)");

int main(int argc, char** argv) {
  const std::string name = "kvcache-worker";
  kvcache::InitProcess(argc, argv, name, "kvcache-worker: KV-cache-centred LLM worker. See --help.");
  auto options = kvcache::ServerOptionsFromFlags(name);
  if (!options.ok()) kvcache::DieWith(name, options.status());
  auto process = kvcache::ServerProcess::Init(*options);
  if (!process.ok()) kvcache::DieWith(name, process.status(), 1);
  kvcache::v1::Worker::CallbackService service;
  absl::Status served = (*process)->Serve({&service});
  if (!served.ok()) kvcache::DieWith(name, served, 1);
  return 0;
}
