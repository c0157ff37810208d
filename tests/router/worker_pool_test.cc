// WorkerPool against in-process fake workers (a Watch that sends a snapshot and
// stays open until cancelled): a worker that leaves the membership is gone at
// once, its Watch thread joined and its entries out of the directory, rather
// than parked until the pool stops.
#include "router/worker_pool.h"

#include <dirent.h>

#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kvcache/v1/worker.grpc.pb.h"

namespace kvcache::router {
namespace {

// Threads of this process named `name` (the pool names its Watch threads).
int ThreadsNamed(const std::string& name) {
  int n = 0;
  DIR* dir = opendir("/proc/self/task");
  if (dir == nullptr) return -1;
  while (dirent* e = readdir(dir)) {
    if (e->d_name[0] == '.') continue;
    std::ifstream in(absl::StrCat("/proc/self/task/", e->d_name, "/comm"));
    std::string comm;
    std::getline(in, comm);
    n += comm == name ? 1 : 0;
  }
  closedir(dir);
  return n;
}

// Watch: a snapshot holding one session, then nothing until the subscriber
// cancels.
class FakeWorker final : public v1::Worker::CallbackService {
 public:
  explicit FakeWorker(std::string session) : session_(std::move(session)) {}

  grpc::ServerWriteReactor<v1::WatchEvent>* Watch(grpc::CallbackServerContext* /*context*/,
                                                  const v1::WatchRequest* /*request*/) override {
    class Reactor : public grpc::ServerWriteReactor<v1::WatchEvent> {
     public:
      explicit Reactor(const std::string& session) {
        event_.set_sequence(1);
        v1::WorkerSnapshot* snap = event_.mutable_snapshot();
        snap->set_worker_id("fake");
        auto* s = snap->add_sessions();
        s->set_session_id(session);
        s->set_tenant("t");
        s->set_tokens_cached(16);
        StartWrite(&event_);
      }
      void OnWriteDone(bool /*ok*/) override {}
      void OnCancel() override { Finish(grpc::Status::CANCELLED); }
      void OnDone() override { delete this; }

     private:
      v1::WatchEvent event_;
    };
    return new Reactor(session_);
  }

 private:
  const std::string session_;
};

struct FakeServer {
  explicit FakeServer(const std::string& session) : service(session) {
    grpc::ServerBuilder b;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    b.RegisterService(&service);
    server = b.BuildAndStart();
  }
  ~FakeServer() { server->Shutdown(); }
  std::string address() const { return absl::StrCat("127.0.0.1:", port); }

  FakeWorker service;
  int port = 0;
  std::unique_ptr<grpc::Server> server;
};

TEST(WorkerPoolTest, ARetiredWorkerIsJoinedAndForgottenAtOnce) {
  std::vector<std::unique_ptr<FakeServer>> fakes;
  std::vector<std::string> addresses;
  for (int i = 0; i < 4; ++i) {
    fakes.push_back(std::make_unique<FakeServer>(absl::StrCat("s", i)));
    ASSERT_NE(fakes.back()->server, nullptr);
    addresses.push_back(fakes.back()->address());
  }
  Directory directory;
  WorkerPool pool(WorkerPoolOptions{}, &directory);
  for (int round = 0; round < 3; ++round) {
    pool.SetAddresses(addresses);
    for (int i = 0; i < 4; ++i) {
      ASSERT_TRUE(directory.AwaitSession({"t", absl::StrCat("s", i)}, absl::Seconds(30)).has_value());
    }
    EXPECT_EQ(ThreadsNamed("kv-watch"), 4);
    // Two leave: their threads are joined before SetAddresses returns, and
    // nothing of them is left for a late snapshot to bring back.
    pool.SetAddresses({addresses[0], addresses[1]});
    EXPECT_EQ(ThreadsNamed("kv-watch"), 2) << "round " << round;
    EXPECT_FALSE(directory.FindSession({"t", "s2"}).has_value());
    EXPECT_FALSE(directory.FindSession({"t", "s3"}).has_value());
    EXPECT_TRUE(directory.FindSession({"t", "s0"}).has_value());
    EXPECT_EQ(pool.Workers().size(), 2u);
    pool.SetAddresses({});
    EXPECT_EQ(ThreadsNamed("kv-watch"), 0) << "round " << round;
    EXPECT_EQ(directory.session_count(), 0u);
  }
  pool.Stop();
}

}  // namespace
}  // namespace kvcache::router
