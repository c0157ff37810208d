#include "tests/testing/dns_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace kvcache::testing {
namespace {

constexpr uint16_t kTypeA = 1;
constexpr uint16_t kClassIn = 1;

uint16_t Get16(const std::string& b, size_t at) {
  return static_cast<uint16_t>((static_cast<uint8_t>(b[at]) << 8) | static_cast<uint8_t>(b[at + 1]));
}
void Put16(std::string* b, uint16_t v) {
  b->push_back(static_cast<char>(v >> 8));
  b->push_back(static_cast<char>(v & 0xff));
}

}  // namespace

absl::StatusOr<std::unique_ptr<DnsServer>> DnsServer::Start() {
  std::unique_ptr<DnsServer> s(new DnsServer());
  s->fd_ = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (s->fd_ < 0) return absl::InternalError(absl::StrCat("socket: ", strerror(errno)));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (bind(s->fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return absl::InternalError(absl::StrCat("bind: ", strerror(errno)));
  }
  socklen_t len = sizeof(addr);
  getsockname(s->fd_, reinterpret_cast<sockaddr*>(&addr), &len);
  s->port_ = ntohs(addr.sin_port);
  s->thread_ = std::thread([raw = s.get()] { raw->Serve(); });
  return s;
}

DnsServer::~DnsServer() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
  if (fd_ >= 0) close(fd_);
}

std::string DnsServer::address() const { return absl::StrCat("127.0.0.1:", port_); }

void DnsServer::SetAddresses(const std::string& name, std::vector<std::string> ipv4) {
  absl::MutexLock lock(&mu_);
  records_[name] = std::move(ipv4);
}

void DnsServer::SetMode(Mode mode) {
  absl::MutexLock lock(&mu_);
  mode_ = mode;
}

void DnsServer::Serve() {
  char buf[1500];
  while (!stop_) {
    pollfd p{fd_, POLLIN, 0};
    if (poll(&p, 1, 50) <= 0) continue;
    sockaddr_in from{};
    socklen_t from_len = sizeof(from);
    const ssize_t n = recvfrom(fd_, buf, sizeof(buf), 0, reinterpret_cast<sockaddr*>(&from), &from_len);
    if (n < 12) continue;
    const std::string reply = Answer(std::string(buf, static_cast<size_t>(n)));
    if (reply.empty()) continue;
    answered_.fetch_add(1);
    sendto(fd_, reply.data(), reply.size(), 0, reinterpret_cast<sockaddr*>(&from), from_len);
  }
}

// One reply to one query (empty: stay silent). Handles the one-question
// queries resolvers send; compression pointers are only written, never read.
std::string DnsServer::Answer(const std::string& q) {
  Mode mode;
  std::vector<std::string> ips;
  // Question: labels from byte 12, then type and class.
  size_t at = 12;
  std::string name;
  while (at < q.size() && q[at] != 0) {
    const size_t len = static_cast<uint8_t>(q[at]);
    if (len > 63 || at + 1 + len > q.size()) return "";
    if (!name.empty()) name.push_back('.');
    for (size_t i = 0; i < len; ++i) name.push_back(static_cast<char>(std::tolower(q[at + 1 + i])));
    at += 1 + len;
  }
  if (at + 5 > q.size()) return "";
  const size_t question_end = at + 5;
  const uint16_t type = Get16(q, at + 1);
  {
    absl::MutexLock lock(&mu_);
    mode = mode_;
    auto it = records_.find(name);
    if (it != records_.end() && type == kTypeA) ips = it->second;
  }
  if (mode == Mode::kSilent) return "";
  std::string r = q.substr(0, question_end);
  // Flags: response, authoritative, recursion available; the query's RD bit.
  const bool rd = (static_cast<uint8_t>(q[2]) & 0x01) != 0;
  r[2] = static_cast<char>(0x84 | (rd ? 0x01 : 0x00));
  uint8_t rcode = 0;  // NOERROR
  if (mode == Mode::kServFail) rcode = 2;
  r[3] = static_cast<char>(0x80 | rcode);
  if (mode != Mode::kAnswer) ips.clear();
  // Counts: one question, the answers, no authority or additional records.
  r[4] = 0;
  r[5] = 1;
  r[6] = static_cast<char>(ips.size() >> 8);
  r[7] = static_cast<char>(ips.size() & 0xff);
  std::memset(&r[8], 0, 4);
  for (const std::string& ip : ips) {
    in_addr a{};
    if (inet_pton(AF_INET, ip.c_str(), &a) != 1) continue;
    Put16(&r, 0xc00c);  // the question's name
    Put16(&r, kTypeA);
    Put16(&r, kClassIn);
    r.append("\0\0\0\0", 4);  // TTL 0: resolvers must not cache the test's answers
    Put16(&r, 4);
    r.append(reinterpret_cast<const char*>(&a), 4);
  }
  return r;
}

}  // namespace kvcache::testing
