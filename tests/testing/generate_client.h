// Test helpers that run one Generate call against a worker or a router and
// collect the stream: the requests the integration tests send, in one place.
//
// Thread-safety: each call uses its own ClientContext; a PartialStream is used
// by one thread at a time.
#ifndef KVCACHE_TESTS_TESTING_GENERATE_CLIENT_H_
#define KVCACHE_TESTS_TESTING_GENERATE_CLIENT_H_

#include <chrono>
#include <memory>
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

// A Generate stream read in parts, for tests that act mid-stream (cancel it,
// kill or freeze its worker): ReadTokens, act, then Finish. Destroyed before
// Finish, it cancels the call and reads it to the end.
class PartialStream {
 public:
  // `stub`: a Worker or a KvCache stub. `bearer_token` (when not empty) goes
  // into the authorization metadata.
  template <typename Stub>
  PartialStream(Stub* stub, const v1::GenerateRequest& request, absl::Duration deadline = absl::Seconds(60),
                const std::string& bearer_token = "") {
    ctx_.set_deadline(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(deadline));
    if (!bearer_token.empty()) ctx_.AddMetadata("authorization", "Bearer " + bearer_token);
    reader_ = stub->Generate(&ctx_, request);
  }
  ~PartialStream() {
    if (finished_) return;
    Cancel();
    Finish();
  }
  PartialStream(const PartialStream&) = delete;
  PartialStream& operator=(const PartialStream&) = delete;

  // Reads until `n` tokens have come in all; false when the stream ended, or
  // sent its final message, first.
  bool ReadTokens(size_t n) {
    v1::GenerateResponse msg;
    while (reply_.tokens.size() < n) {
      if (!reader_->Read(&msg) || !Take(&msg)) return false;
    }
    return true;
  }
  void Cancel() { ctx_.TryCancel(); }
  // Reads the rest of the stream; the whole reply, its status included.
  const Reply& Finish() {
    v1::GenerateResponse msg;
    while (reader_->Read(&msg)) Take(&msg);
    reply_.status = reader_->Finish();
    finished_ = true;
    return reply_;
  }
  const Reply& reply() const { return reply_; }

 private:
  // Adds a token (true) or the final message (false) to the reply.
  bool Take(v1::GenerateResponse* msg) {
    if (!msg->has_token()) {
      if (msg->has_final()) reply_.final = msg->final();
      return false;
    }
    reply_.tokens.push_back(msg->token().id());
    reply_.text += msg->token().text();
    return true;
  }

  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader_;
  Reply reply_;
  bool finished_ = false;
};

// Runs the call on `stub` and reads the whole stream.
template <typename Stub>
Reply Generate(Stub* stub, const v1::GenerateRequest& request, absl::Duration deadline = absl::Seconds(60),
               const std::string& bearer_token = "") {
  PartialStream stream(stub, request, deadline, bearer_token);
  return stream.Finish();
}

}  // namespace kvcache::testing

#endif  // KVCACHE_TESTS_TESTING_GENERATE_CLIENT_H_
