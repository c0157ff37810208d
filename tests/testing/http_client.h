// An HTTP/1.1 client for tests and benchmarks of the router's HTTP front door,
// on libevent's evhttp client: keep-alive connections on an event loop the
// caller runs, so that one thread can hold thousands of them.
//
// Thread-safety: an HttpConnection and its callbacks belong to the thread
// that runs its event_base.
#ifndef KVCACHE_TESTS_TESTING_HTTP_CLIENT_H_
#define KVCACHE_TESTS_TESTING_HTTP_CLIENT_H_

#include <functional>
#include <map>
#include <string>

#include "absl/time/clock.h"
#include "absl/time/time.h"

struct event_base;
struct evhttp_connection;

namespace kvcache::testing {

// What one HTTP exchange delivered.
struct HttpResult {
  int status = 0;  // 0: the connection failed before a response
  std::string body;
  int chunks = 0;  // body reads (one per SSE event or more when they came together)
  absl::Time sent;
  absl::Time first_chunk = absl::InfinitePast();  // when the first body bytes arrived
  absl::Time done;
};

using HttpHeaders = std::map<std::string, std::string>;

// One keep-alive connection to 127.0.0.1:`port`, opened with the first request.
class HttpConnection {
 public:
  HttpConnection(event_base* base, int port);
  ~HttpConnection();
  HttpConnection(const HttpConnection&) = delete;
  HttpConnection& operator=(const HttpConnection&) = delete;

  // Sends GET (empty `body`) or POST `path`; `done` runs on the loop thread
  // when the response is complete or the connection failed. `on_chunk`
  // (optional) runs after each body read.
  void Send(const std::string& method, const std::string& path, const std::string& body,
            const HttpHeaders& headers, std::function<void(const HttpResult&)> done,
            std::function<void(const HttpResult&)> on_chunk = nullptr);

 private:
  evhttp_connection* evcon_ = nullptr;
};

// One request on a connection and loop of its own, waiting up to `timeout`.
HttpResult HttpFetch(int port, const std::string& method, const std::string& path,
                     const std::string& body = "", const HttpHeaders& headers = {},
                     absl::Duration timeout = absl::Seconds(60));

}  // namespace kvcache::testing

#endif  // KVCACHE_TESTS_TESTING_HTTP_CLIENT_H_
