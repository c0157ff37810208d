// Randomized model-based test: thousands of mixed operations against a reference
// model (session -> tenant, tokens), checking after every operation that the cache
// agrees with the model, holds the right K/V bytes for every live token, and keeps
// its structural invariants. The seed is printed on failure.
#include <cstdio>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/worker/kv/kv_test_util.h"
#include "worker/kv/kv_cache_manager.h"
#include "worker/kv/kv_transfer.h"

namespace kvcache::kv {
namespace {

using ::kvcache::kv::testing::AppendWithKv;
using ::kvcache::kv::testing::SmallOptions;
using ::kvcache::kv::testing::VerifyKv;

constexpr int kMaxTokens = 120;

struct RefSession {
  std::string tenant;
  std::vector<int32_t> tokens;
  bool pinned = false;
};

class ModelTest {
 public:
  ModelTest(uint32_t seed, int window) : rng_(seed) {
    auto m = KvCacheManager::Create(SmallOptions(/*tier0=*/48, /*tier1=*/24, window));
    EXPECT_TRUE(m.ok());
    m_ = std::move(m).value();
    // Shared "system prompts" so prefixes collide across sessions.
    for (int p = 0; p < 3; ++p) {
      std::vector<int32_t> prompt;
      for (int i = 0, n = Uniform(6, 22); i < n; ++i) prompt.push_back(Uniform(0, 50));
      prompts_.push_back(prompt);
    }
  }

  void Run(int ops) {
    for (int i = 0; i < ops; ++i) {
      SCOPED_TRACE("op #" + std::to_string(i));
      Step();
      if (::testing::Test::HasFatalFailure()) return;
      ApplyDropEvents();
      Check();
      if (::testing::Test::HasFatalFailure()) return;
    }
    const KvStats st = m_->GetStats();
    // Coverage of the policy paths, visible in the test log.
    std::printf(
        "  offloads=%lld restores=%lld drops=%lld preemptions=%lld evicted=%lld "
        "prefix_hit=%lld/%lld tokens\n",
        static_cast<long long>(st.offloads), static_cast<long long>(st.restores),
        static_cast<long long>(st.drops), static_cast<long long>(st.preemptions),
        static_cast<long long>(st.prefix_pages_evicted), static_cast<long long>(st.prefix_hit_tokens),
        static_cast<long long>(st.prefix_query_tokens));
    EXPECT_GT(st.offloads, 0);
    EXPECT_GT(st.restores, 0);
    EXPECT_GT(st.drops, 0);
    EXPECT_GT(st.prefix_pages_evicted, 0);
    EXPECT_GT(st.prefix_hit_tokens, 0);
  }

 private:
  int Uniform(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }
  std::vector<int32_t> RandomTokens(int n) {
    std::vector<int32_t> t;
    for (int i = 0; i < n; ++i) t.push_back(Uniform(0, 50));
    return t;
  }
  std::string PickLive() {
    if (ref_.empty()) return "";
    auto it = ref_.begin();
    std::advance(it, Uniform(0, static_cast<int>(ref_.size()) - 1));
    return it->first;
  }
  std::string NewId() { return "s" + std::to_string(next_id_++); }

  void Step() {
    const int op = Uniform(0, 99);
    const std::string id = PickLive();
    if (op < 12 || ref_.empty()) {  // create, attaching a cached prefix
      const std::string nid = NewId();
      const std::string tenant = Uniform(0, 1) ? "alice" : "bob";
      ASSERT_TRUE(m_->CreateSession(nid, tenant).ok());
      ref_[nid] = RefSession{tenant, {}};
      std::vector<int32_t> prompt = prompts_[Uniform(0, 2)];
      const std::vector<int32_t> tail = RandomTokens(Uniform(0, 10));
      prompt.insert(prompt.end(), tail.begin(), tail.end());
      auto hit = m_->AttachPrefix(nid, prompt);
      ASSERT_TRUE(hit.ok()) << hit.status();
      ASSERT_EQ(*hit % m_->shape().page_tokens, 0);
      ASSERT_LE(*hit, static_cast<int64_t>(prompt.size()));
      ref_[nid].tokens.assign(prompt.begin(), prompt.begin() + *hit);
      const std::vector<int32_t> rest(prompt.begin() + *hit, prompt.end());
      Append(nid, rest);
    } else if (op < 45) {  // decode / prefill
      Append(id, RandomTokens(Uniform(1, 12)));
    } else if (op < 52) {  // truncate
      const int64_t len = static_cast<int64_t>(ref_[id].tokens.size());
      const int64_t to = Uniform(0, static_cast<int>(len) + 2);
      const absl::Status st = m_->Truncate(id, to);
      if (to > len) {
        ASSERT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
      } else if (st.ok()) {
        ref_[id].tokens.resize(to);
      } else {
        // Only the sliding window can refuse a valid length.
        ASSERT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
        ASSERT_GT(m_->shape().sliding_window, 0);
      }
    } else if (op < 60) {  // fork
      const std::string nid = NewId();
      const absl::Status st = m_->Fork(id, nid);
      if (st.ok()) {
        ref_[nid] = RefSession{ref_[id].tenant, ref_[id].tokens};
      } else {
        ASSERT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
      }
    } else if (op < 67) {  // close
      ASSERT_TRUE(m_->CloseSession(id).ok());
      ref_.erase(id);
      closed_.push_back(id);
    } else if (op < 74) {  // offload
      const absl::Status st = m_->Offload(id);
      if (ref_[id].pinned) {
        ASSERT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
      } else {
        ASSERT_TRUE(st.ok() || st.code() == absl::StatusCode::kResourceExhausted) << st;
      }
    } else if (op < 80) {  // restore
      const absl::Status st = m_->Restore(id);
      ASSERT_TRUE(st.ok() || st.code() == absl::StatusCode::kResourceExhausted) << st;
    } else if (op < 84) {  // pin / unpin / idle
      const int which = Uniform(0, 2);
      const absl::Status st = which == 0   ? m_->PinSession(id)
                              : which == 1 ? m_->UnpinSession(id)
                                           : m_->MarkIdle(id);
      ASSERT_TRUE(st.ok() || st.code() == absl::StatusCode::kResourceExhausted) << st;
      if (st.ok() && which < 2) ref_[id].pinned = which == 0;
    } else if (op < 88) {  // a step in progress blocks moves and closes, then aborts
      auto r = m_->BeginStep(id, Uniform(0, 5));
      if (!r.ok()) {
        ASSERT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
        return;
      }
      ASSERT_EQ(m_->Offload(id).code(), absl::StatusCode::kFailedPrecondition);
      ASSERT_EQ(m_->CloseSession(id).code(), absl::StatusCode::kFailedPrecondition);
      ASSERT_TRUE(m_->CheckInvariants().ok()) << m_->CheckInvariants();
      ASSERT_TRUE(m_->AbortStep(id).ok());
    } else if (op < 95) {  // export -> import as a new session (pre-copy half the time)
      ExportImport(id, Uniform(0, 1) == 1);
    } else {  // bad calls
      if (!closed_.empty()) {
        const std::string& c = closed_[Uniform(0, static_cast<int>(closed_.size()) - 1)];
        if (!ref_.count(c)) {
          ASSERT_EQ(m_->Fork(c, NewId()).code(), absl::StatusCode::kFailedPrecondition);
        }
      }
      ASSERT_EQ(m_->AppendTokens("unknown", {1}).code(), absl::StatusCode::kNotFound);
      ASSERT_EQ(m_->CreateSession(id, "alice").code(), absl::StatusCode::kAlreadyExists);
      ASSERT_EQ(m_->BeginStep(id, 1 << 20).status().code(), absl::StatusCode::kInvalidArgument);
    }
  }

  void Append(const std::string& id, const std::vector<int32_t>& tokens) {
    if (tokens.empty()) return;
    if (static_cast<int>(ref_[id].tokens.size() + tokens.size()) > kMaxTokens) return;
    const absl::Status st = AppendWithKv(*m_, id, tokens);
    if (st.ok()) {
      // The cache may have dropped this session's own cache only before the step
      // (restore DATA_LOSS is not exercised here), so the model appends.
      ApplyDropEvents();
      auto& t = ref_[id].tokens;
      t.insert(t.end(), tokens.begin(), tokens.end());
    } else {
      ASSERT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
    }
  }

  void ExportImport(const std::string& id, bool precopy) {
    const std::string nid = NewId();
    ExportOptions eo;
    eo.max_chunk_bytes = 1024 + 512 * Uniform(0, 3);
    auto exp = SessionExporter::Create(m_.get(), id, eo);
    ASSERT_TRUE(exp.ok()) << exp.status();
    std::vector<KvChunk> chunks;
    KvChunk c;
    while (true) {
      auto more = (*exp)->NextBulk(&c);
      ASSERT_TRUE(more.ok()) << more.status();
      if (!*more) break;
      chunks.push_back(c);
      if (precopy && Uniform(0, 2) == 0) Append(id, RandomTokens(Uniform(1, 3)));
    }
    if (precopy && Uniform(0, 1) == 0 && !ref_[id].tokens.empty()) {
      const int64_t to = Uniform(0, static_cast<int>(ref_[id].tokens.size()));
      if (m_->Truncate(id, to).ok()) ref_[id].tokens.resize(to);
    }
    while (true) {
      auto more = (*exp)->NextFinal(&c);
      ASSERT_TRUE(more.ok()) << more.status();
      if (!*more) break;
      chunks.push_back(c);
    }
    ApplyDropEvents();
    ImportOptions io;
    io.session_id = nid;
    const absl::Status st = ImportSession(m_.get(), chunks, io);
    if (st.ok()) {
      ref_[nid] = RefSession{ref_[id].tenant, ref_[id].tokens};
    } else {
      ASSERT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
    }
  }

  // The policy may cut other sessions (tier-1 drops); the events say to what length.
  void ApplyDropEvents() {
    EventBatch b = m_->ReadEvents(seq_, 1 << 20);
    ASSERT_FALSE(b.gap);
    for (const KvEvent& e : b.events) {
      if (e.type != KvEventType::kSessionDropped) continue;
      auto it = ref_.find(e.session_id);
      ASSERT_NE(it, ref_.end());
      ASSERT_LE(e.num_tokens, static_cast<int64_t>(it->second.tokens.size()));
      it->second.tokens.resize(e.num_tokens);
    }
    seq_ = b.last_seq;
  }

  void Check() {
    ASSERT_TRUE(m_->CheckInvariants().ok()) << m_->CheckInvariants();
    const KvStats st = m_->GetStats();
    ASSERT_EQ(st.sessions, static_cast<int64_t>(ref_.size()));
    std::set<PageId> pinned_pages;
    for (int t = 0; t < 2; ++t) {
      const TierStats& ts = st.tier[t];
      ASSERT_EQ(ts.free_pages + ts.session_private_pages + ts.prefix_shared_pages +
                    ts.cached_unreferenced_pages + ts.in_flight_pages,
                ts.capacity_pages);
      ASSERT_GE(ts.session_private_pages, 0);
    }
    ASSERT_EQ(st.tier[0].in_flight_pages, 0);
    ASSERT_GE(st.waste_token_slots, 0);
    for (const auto& [id, ref] : ref_) {
      auto tokens = m_->GetTokens(id);
      ASSERT_TRUE(tokens.ok()) << tokens.status();
      ASSERT_EQ(*tokens, ref.tokens) << id;
      const absl::Status kv = VerifyKv(*m_, id);
      ASSERT_TRUE(kv.ok()) << kv;
      auto info = m_->GetSession(id);
      ASSERT_EQ(info->user_pinned, ref.pinned);
      if (ref.pinned) {
        ASSERT_EQ(info->tier1_pages, 0) << id;  // pinned sessions stay in tier 0
        // Pages that pinned sessions share (forks) count once.
        for (size_t p = info->first_live_page; p < info->page_ids.size(); ++p) {
          if (info->page_tiers[p] == 0) pinned_pages.insert(info->page_ids[p]);
        }
      }
    }
    ASSERT_LE(static_cast<int64_t>(pinned_pages.size()), st.tier[0].capacity_pages);
  }

  std::mt19937 rng_;
  std::unique_ptr<KvCacheManager> m_;
  std::map<std::string, RefSession> ref_;
  std::vector<std::string> closed_;
  std::vector<std::vector<int32_t>> prompts_;
  uint64_t seq_ = 0;
  int next_id_ = 0;
};

class KvModelTest : public ::testing::TestWithParam<int> {};

TEST_P(KvModelTest, RandomOperationsAgreeWithReferenceModel) {
  const int window = GetParam();
  for (uint32_t seed : {1u, 2u, 3u}) {
    SCOPED_TRACE("seed=" + std::to_string(seed) + " window=" + std::to_string(window));
    ModelTest t(seed, window);
    t.Run(3000);
    if (HasFatalFailure()) return;
  }
}

INSTANTIATE_TEST_SUITE_P(Windows, KvModelTest, ::testing::Values(0, 12));

}  // namespace
}  // namespace kvcache::kv
