// Test helpers that run one Generate call against a worker or a router and
// collect the stream: the requests the integration tests send, in one place.
//
// Thread-safety: free functions; each call uses its own ClientContext.
#ifndef KVCACHE_TESTS_TESTING_GENERATE_CLIENT_H_
#define KVCACHE_TESTS_TESTING_GENERATE_CLIENT_H_

#include <chrono>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "kvcache/v1/common.pb.h"

namespace kvcache::testing {

// What one Generate stream delivered.
struct Reply {
  std::vector<int32_t> tokens;
  std::string text;
  v1::GenerateResponse::Final final;
  grpc::Status status;
};

// A greedy request generating exactly `max_tokens` tokens (EOS ignored).
inline v1::GenerateRequest TextRequest(const std::string& session, const std::string& text, int max_tokens,
                                       v1::Mode mode = v1::FULL_CONTEXT) {
  v1::GenerateRequest r;
  r.set_session_id(session);
  r.set_mode(mode);
  r.mutable_input()->set_text(text);
  r.mutable_sampling()->set_max_tokens(max_tokens);
  r.mutable_sampling()->set_ignore_eos(true);
  return r;
}

// The same over explicit token ids, so that a test knows every token.
inline v1::GenerateRequest TokensRequest(const std::string& session, const std::vector<int32_t>& ids,
                                         int max_tokens, v1::Mode mode = v1::FULL_CONTEXT) {
  v1::GenerateRequest r = TextRequest(session, "", max_tokens, mode);
  r.mutable_input()->mutable_tokens()->mutable_ids()->Assign(ids.begin(), ids.end());
  return r;
}

// Runs the call on `stub` (a Worker or a KvCache stub) and reads the whole
// stream. `bearer_token` (when not empty) goes into the authorization metadata.
template <typename Stub>
Reply Generate(Stub* stub, const v1::GenerateRequest& request, absl::Duration deadline = absl::Seconds(60),
               const std::string& bearer_token = "") {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(deadline));
  if (!bearer_token.empty()) ctx.AddMetadata("authorization", "Bearer " + bearer_token);
  auto reader = stub->Generate(&ctx, request);
  Reply r;
  v1::GenerateResponse msg;
  while (reader->Read(&msg)) {
    if (msg.has_token()) {
      r.tokens.push_back(msg.token().id());
      r.text += msg.token().text();
    } else if (msg.has_final()) {
      r.final = msg.final();
    }
  }
  r.status = reader->Finish();
  return r;
}

}  // namespace kvcache::testing

#endif  // KVCACHE_TESTS_TESTING_GENERATE_CLIENT_H_
