// A small authoritative DNS server on loopback UDP for tests: answers A queries
// for the names it is given, and can be told to fail (SERVFAIL), answer empty
// (NOERROR, no records) or stay silent, as a cluster's DNS does during an
// outage or while the endpoints controller updates a headless Service.
//
// Thread-safety: every method may be called from any thread; one thread serves.
#ifndef KVCACHE_TESTS_TESTING_DNS_SERVER_H_
#define KVCACHE_TESTS_TESTING_DNS_SERVER_H_

#include <atomic>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace kvcache::testing {

class DnsServer {
 public:
  enum class Mode { kAnswer, kServFail, kEmpty, kSilent };

  // Binds 127.0.0.1 on a free UDP port and starts serving.
  static absl::StatusOr<std::unique_ptr<DnsServer>> Start();
  ~DnsServer();

  int port() const { return port_; }
  // "127.0.0.1:PORT", for dns://127.0.0.1:PORT/name:port.
  std::string address() const;

  // The A records of `name` (lower case, no trailing dot).
  void SetAddresses(const std::string& name, std::vector<std::string> ipv4);
  void SetMode(Mode mode);
  // Queries answered so far (any mode but kSilent).
  int answered() const { return answered_.load(); }

 private:
  DnsServer() = default;
  void Serve();
  std::string Answer(const std::string& query);

  int fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<int> answered_{0};
  std::thread thread_;
  absl::Mutex mu_;
  std::map<std::string, std::vector<std::string>> records_ ABSL_GUARDED_BY(mu_);
  Mode mode_ ABSL_GUARDED_BY(mu_) = Mode::kAnswer;
};

}  // namespace kvcache::testing

#endif  // KVCACHE_TESTS_TESTING_DNS_SERVER_H_
