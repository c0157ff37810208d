#include "tests/testing/http_client.h"

#include <event2/buffer.h>
#include <event2/event.h>
#include <event2/http.h>

#include <map>
#include <memory>
#include <utility>

namespace kvcache::testing {
namespace {

// One request in flight: owned by libevent's callbacks until `done` ran.
struct Call {
  HttpResult result;
  std::function<void(const HttpResult&)> done;
  std::function<void(const HttpResult&)> on_chunk;
};

void TakeBody(evhttp_request* req, HttpResult* result) {
  evbuffer* in = evhttp_request_get_input_buffer(req);
  const size_t n = evbuffer_get_length(in);
  if (n == 0) return;
  const size_t old = result->body.size();
  result->body.resize(old + n);
  evbuffer_remove(in, result->body.data() + old, n);
  if (result->first_chunk == absl::InfinitePast()) result->first_chunk = absl::Now();
  ++result->chunks;
}

void OnChunk(evhttp_request* req, void* arg) {
  auto* call = static_cast<Call*>(arg);
  TakeBody(req, &call->result);
  if (call->on_chunk) call->on_chunk(call->result);
}

void OnDone(evhttp_request* req, void* arg) {
  std::unique_ptr<Call> call(static_cast<Call*>(arg));
  if (req != nullptr) {
    call->result.status = evhttp_request_get_response_code(req);
    TakeBody(req, &call->result);
  }
  call->result.done = absl::Now();
  call->done(call->result);
}

}  // namespace

HttpConnection::HttpConnection(event_base* base, int port)
    : evcon_(evhttp_connection_base_new(base, nullptr, "127.0.0.1", static_cast<uint16_t>(port))) {}

HttpConnection::~HttpConnection() {
  if (evcon_ != nullptr) evhttp_connection_free(evcon_);
}

void HttpConnection::Send(const std::string& method, const std::string& path, const std::string& body,
                          const HttpHeaders& headers, std::function<void(const HttpResult&)> done,
                          std::function<void(const HttpResult&)> on_chunk) {
  auto* call = new Call{HttpResult(), std::move(done), std::move(on_chunk)};
  call->result.sent = absl::Now();
  evhttp_request* req = evhttp_request_new(&OnDone, call);
  evhttp_request_set_chunked_cb(req, &OnChunk);
  evkeyvalq* out = evhttp_request_get_output_headers(req);
  evhttp_add_header(out, "Host", "127.0.0.1");
  for (const auto& [k, v] : headers) evhttp_add_header(out, k.c_str(), v.c_str());
  if (!body.empty()) {
    evhttp_add_header(out, "Content-Type", "application/json");
    evbuffer_add(evhttp_request_get_output_buffer(req), body.data(), body.size());
  }
  // On failure evhttp_make_request frees the request and runs no callback.
  static const auto* const kMethods = new std::map<std::string, evhttp_cmd_type>{
      {"GET", EVHTTP_REQ_GET},     {"POST", EVHTTP_REQ_POST},     {"HEAD", EVHTTP_REQ_HEAD},
      {"PUT", EVHTTP_REQ_PUT},     {"DELETE", EVHTTP_REQ_DELETE}, {"OPTIONS", EVHTTP_REQ_OPTIONS},
      {"TRACE", EVHTTP_REQ_TRACE}, {"PATCH", EVHTTP_REQ_PATCH}};
  const auto m = kMethods->find(method);
  if (m == kMethods->end()) evhttp_request_free(req);
  if (m == kMethods->end() || evhttp_make_request(evcon_, req, m->second, path.c_str()) != 0) {
    std::unique_ptr<Call> failed(call);
    failed->result.done = absl::Now();
    failed->done(failed->result);
  }
}

HttpResult HttpFetch(int port, const std::string& method, const std::string& path, const std::string& body,
                     const HttpHeaders& headers, absl::Duration timeout) {
  event_base* base = event_base_new();
  HttpResult result;
  {
    HttpConnection conn(base, port);
    conn.Send(method, path, body, headers, [&](const HttpResult& r) {
      result = r;
      event_base_loopbreak(base);
    });
    const timeval tv = absl::ToTimeval(timeout);
    event_base_loopexit(base, &tv);
    event_base_dispatch(base);
  }
  event_base_free(base);
  return result;
}

}  // namespace kvcache::testing
