// Router replicas fed by the same simulated fleet (tests/bench/fleet_sim.h):
// with delays, reordering and lost messages injected into their Watch streams,
// sequence numbers detect every gap, a gap resyncs from a fresh snapshot, and
// the replicas converge to the same directory (equal digests, equal to one
// built from the workers' own snapshots) once the faults stop; their placements
// then agree. Concurrent bursts through several routers stay spread.
//
// Time is simulated (ticks), so nothing here sleeps or depends on the machine.
#include <algorithm>
#include <cstdio>
#include <deque>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/bench/fleet_sim.h"

namespace kvcache::router {
namespace {

sim::FleetConfig SmallFleet() {
  sim::FleetConfig cfg;
  cfg.workers = 8;
  cfg.sessions = 400;
  cfg.context_tokens = 512;
  cfg.device_blocks = 256;
  cfg.host_blocks = 512;
  cfg.system_prompts = 6;
  cfg.system_prompt_tokens = 128;
  cfg.turn_tokens = 64;
  cfg.prefill_event_blocks = 4;
  cfg.snapshot_part_hashes = 64;  // several parts per snapshot
  cfg.load_report_every = 8;
  return cfg;
}

struct Faults {
  double drop = 0;     // a message is lost
  double reorder = 0;  // a message overtakes the one before it
  int max_delay = 0;   // ticks a message may wait (in order)
};

// One replica's stream from one worker, as a network would deliver it.
struct Link {
  struct Pending {
    int64_t due = 0;
    uint64_t epoch = 0;  // the stream it belongs to
    v1::WatchEvent message;
  };
  sim::WatchStream stream;
  std::deque<Pending> queue;
  uint64_t epoch = 0;
  int64_t last_due = 0;
  int resyncs = 0;
};

// Replicas of the router, each with its own links, faults and random source.
class Harness {
 public:
  Harness(sim::Fleet* fleet, int replicas, int resync_delay)
      : fleet_(fleet), resync_delay_(resync_delay), rng_(7) {
    for (int r = 0; r < replicas; ++r) {
      routers_.push_back(std::make_unique<sim::SimRouter>(fleet->workers()));
      links_.emplace_back(fleet->workers());
      for (int w = 0; w < fleet->workers(); ++w) Open(r, w, /*delay=*/0);
    }
  }

  // Opens a new stream: the worker's snapshot now, then what it emits next.
  void Open(int r, int w, int delay) {
    Link& l = links_[r][w];
    ++l.epoch;
    l.stream.Restart();
    routers_[r]->ingest(w).Reset();
    std::vector<v1::WatchEvent> snap = fleet_->Snapshot(w);
    l.stream.Number(&snap);
    l.last_due = std::max(l.last_due, now_ + delay);
    for (auto& m : snap) l.queue.push_back({l.last_due, l.epoch, std::move(m)});
  }

  // Moves every worker's new messages onto every replica's links.
  void Emit(const Faults& f) {
    for (int w = 0; w < fleet_->workers(); ++w) {
      const std::vector<v1::WatchEvent> out = fleet_->TakeOutbox(w);
      for (size_t r = 0; r < routers_.size(); ++r) {
        Link& l = links_[r][w];
        std::vector<v1::WatchEvent> copy = out;
        l.stream.Number(&copy);
        for (auto& m : copy) {
          if (Chance(f.drop)) continue;
          const int delay = f.max_delay > 0 ? static_cast<int>(rng_() % (f.max_delay + 1)) : 0;
          l.last_due = std::max(l.last_due, now_ + delay);
          l.queue.push_back({l.last_due, l.epoch, std::move(m)});
          if (l.queue.size() >= 2 && Chance(f.reorder)) {
            std::swap(l.queue[l.queue.size() - 1].message, l.queue[l.queue.size() - 2].message);
          }
        }
      }
    }
  }

  // Delivers what is due; a gap opens a new stream (the resync).
  void Deliver() {
    for (size_t r = 0; r < routers_.size(); ++r) {
      for (int w = 0; w < fleet_->workers(); ++w) {
        Link& l = links_[r][w];
        while (!l.queue.empty() && l.queue.front().due <= now_) {
          Link::Pending p = std::move(l.queue.front());
          l.queue.pop_front();
          if (p.epoch != l.epoch) continue;  // a stream already abandoned
          if (!routers_[r]->Deliver(w, &p.message).ok()) {
            ++l.resyncs;
            l.queue.clear();
            Open(static_cast<int>(r), w, resync_delay_);
          }
        }
      }
    }
  }

  void Tick() { ++now_; }
  int64_t now() const { return now_; }
  bool Idle() const {
    for (const auto& per_replica : links_) {
      for (const Link& l : per_replica) {
        if (!l.queue.empty()) return false;
      }
    }
    return true;
  }
  int Resyncs(int r) const {
    int n = 0;
    for (const Link& l : links_[r]) n += l.resyncs;
    return n;
  }
  sim::SimRouter& router(int r) { return *routers_[r]; }
  size_t replicas() const { return routers_.size(); }

 private:
  bool Chance(double p) { return p > 0 && std::uniform_real_distribution<double>(0, 1)(rng_) < p; }

  sim::Fleet* fleet_;
  const int resync_delay_;
  std::mt19937_64 rng_;
  int64_t now_ = 0;
  std::vector<std::unique_ptr<sim::SimRouter>> routers_;
  std::vector<std::vector<Link>> links_;  // [replica][worker]
};

// A directory built from every worker's snapshot now: what the fleet holds.
uint64_t GroundTruth(const sim::Fleet& fleet) {
  sim::SimRouter truth(fleet.workers());
  for (int w = 0; w < fleet.workers(); ++w) {
    std::vector<v1::WatchEvent> snap = fleet.Snapshot(w);
    sim::WatchStream s;
    s.Number(&snap);
    for (auto& m : snap) EXPECT_TRUE(truth.Deliver(w, &m).ok());
  }
  return truth.directory().Digest();
}

TEST(ReplicaAgreementTest, ReplicasFedTheSameFleetConvergeDespiteDelaysReorderingAndGaps) {
  sim::Fleet fleet(SmallFleet());
  fleet.Populate();
  constexpr int kMaxDelay = 5;
  constexpr int kResyncDelay = 3;
  Harness h(&fleet, 3, kResyncDelay);
  const Faults faults{/*drop=*/0.002, /*reorder=*/0.002, kMaxDelay};
  for (int t = 0; t < 300; ++t) {
    for (int i = 0; i < 10; ++i) fleet.Step();
    h.Emit(faults);
    h.Deliver();
    h.Tick();
  }
  // Every replica saw gaps and resynced (the faults did something).
  for (size_t r = 0; r < h.replicas(); ++r) EXPECT_GT(h.Resyncs(static_cast<int>(r)), 0) << "replica " << r;

  // Faults stop and the fleet goes quiet: the replicas converge within the
  // longest delay plus one resync.
  const int64_t quiet_since = h.now();
  while (!h.Idle()) {
    h.Tick();
    h.Deliver();
    ASSERT_LE(h.now() - quiet_since, kMaxDelay + kResyncDelay + 2) << "not converged in the bound";
  }
  const uint64_t truth = GroundTruth(fleet);
  for (size_t r = 0; r < h.replicas(); ++r) {
    EXPECT_EQ(h.router(static_cast<int>(r)).directory().Digest(), truth) << "replica " << r;
  }

  // Converged replicas place the same requests on the same workers: new
  // sessions (prefix match, load) and turns of live sessions (affinity).
  int agree = 0, total = 0;
  std::mt19937_64 rng(3);
  for (int i = 0; i < 400; ++i) {
    std::string id, tenant = "t0";
    std::vector<BlockHash> chain;
    if (i % 2 == 0) {
      id = absl::StrCat("fresh-", i);
      chain = fleet.NewRequestChain(i, 4, i);
    } else {
      int64_t s = static_cast<int64_t>(rng() % fleet.session_count());
      while (fleet.WorkerOf(s) < 0) s = static_cast<int64_t>(rng() % fleet.session_count());
      id = fleet.SessionId(s);
      tenant = fleet.Tenant(s);
      chain = fleet.SessionChain(s);
    }
    auto first = h.router(0).Place(id, tenant, chain, 16);
    ASSERT_TRUE(first.ok()) << first.status();
    bool same = true;
    for (size_t r = 1; r < h.replicas(); ++r) {
      auto other = h.router(static_cast<int>(r)).Place(id, tenant, chain, 16);
      ASSERT_TRUE(other.ok()) << other.status();
      same = same && other->worker == first->worker;
    }
    agree += same ? 1 : 0;
    ++total;
  }
  std::printf("converged replicas placed %d of %d requests alike; resyncs %d, %d, %d\n", agree, total,
              h.Resyncs(0), h.Resyncs(1), h.Resyncs(2));
  EXPECT_GE(agree * 100, total * 99) << agree << " of " << total;
}

TEST(ReplicaAgreementTest, WithoutSequenceChecksALostMessageLeavesAReplicaWrong) {
  // The control: the same losses applied blindly (no sequence check, no
  // resync) leave a directory that differs from what the fleet holds.
  sim::Fleet fleet(SmallFleet());
  fleet.Populate();
  Directory blind;
  for (int w = 0; w < fleet.workers(); ++w) {
    v1::WorkerSnapshot whole;  // parts applied one by one would each replace the last
    for (auto& m : fleet.Snapshot(w)) {
      whole.MergeFrom(m.snapshot());
      if (!m.snapshot().more()) {
        blind.ApplySnapshot(sim::Fleet::Address(w), whole);
        whole.Clear();
      }
    }
  }
  std::mt19937_64 rng(11);
  int lost = 0;
  for (int t = 0; t < 200; ++t) {
    for (int i = 0; i < 10; ++i) fleet.Step();
    for (int w = 0; w < fleet.workers(); ++w) {
      for (const auto& m : fleet.TakeOutbox(w)) {
        if (rng() % 200 == 0 && m.has_event()) {
          ++lost;
          continue;
        }
        if (m.has_event()) blind.ApplyEvent(sim::Fleet::Address(w), m.event());
      }
    }
  }
  ASSERT_GT(lost, 0);
  EXPECT_NE(blind.Digest(), GroundTruth(fleet));
}

TEST(ReplicaAgreementTest, ABurstThroughThreeRoutersDoesNotPileOntoTheWorkerWithTheHotPrefix) {
  sim::FleetConfig cfg = SmallFleet();
  cfg.sessions = 8;  // one session per worker: each system prompt lives where its session does
  cfg.system_prompts = 64;
  cfg.system_prompt_tokens = 1024;
  cfg.context_tokens = 1024;
  cfg.device_blocks = 4096;
  cfg.host_blocks = 0;
  sim::Fleet fleet(cfg);
  fleet.Populate();
  const int hot = fleet.PromptOf(0);
  const std::vector<BlockHash> probe = fleet.NewRequestChain(hot, 0, 0);

  // Places a burst through three routers taking turns; workers report their
  // load (requests from every router) every `report_every` requests. The
  // routers' ledgers count what each dispatched when `use_ledger`.
  auto burst = [&](bool use_ledger) {
    std::vector<std::unique_ptr<sim::SimRouter>> routers;
    for (int r = 0; r < 3; ++r) {
      routers.push_back(std::make_unique<sim::SimRouter>(cfg.workers));
      for (int w = 0; w < cfg.workers; ++w) {
        std::vector<v1::WatchEvent> snap = fleet.Snapshot(w);
        sim::WatchStream s;
        s.Number(&snap);
        for (auto& m : snap) EXPECT_TRUE(routers.back()->Deliver(w, &m).ok());
      }
    }
    std::vector<int64_t> on(cfg.workers, 0);
    constexpr int kRequests = 240;
    constexpr int kReportEvery = 24;
    for (int i = 0; i < kRequests; ++i) {
      sim::SimRouter& r = *routers[i % 3];
      // Every request: the hot prompt (64 pages) and 32 pages of its own.
      const std::vector<BlockHash> chain = fleet.NewRequestChain(hot, 32, 1000 + i);
      auto placed = r.Place(absl::StrCat("burst-", i), "t0", chain, 16);
      EXPECT_TRUE(placed.ok());
      const int w = std::stoi(placed->worker.substr(1));
      ++on[w];
      if (use_ledger) {
        r.ledger().Dispatch(placed->worker, chain, 16 * chain.size() - placed->predicted_cached_tokens);
      }
      if ((i + 1) % kReportEvery == 0) {
        for (int x = 0; x < cfg.workers; ++x) {
          v1::WorkerLoad load = fleet.Load(x, on[x]);
          for (auto& rr : routers) rr->directory().ApplyLoad(sim::Fleet::Address(x), load);
        }
      }
    }
    return on;
  };
  // The hot prompt is cached on exactly one worker.
  {
    sim::SimRouter r(cfg.workers);
    for (int w = 0; w < cfg.workers; ++w) {
      std::vector<v1::WatchEvent> snap = fleet.Snapshot(w);
      sim::WatchStream s;
      s.Number(&snap);
      for (auto& m : snap) ASSERT_TRUE(r.Deliver(w, &m).ok());
    }
    ASSERT_EQ(r.directory().MatchPrefix(probe).size(), 1u);
  }
  const std::vector<int64_t> with_ledger = burst(true);
  const std::vector<int64_t> without = burst(false);
  const int64_t max_with = *std::max_element(with_ledger.begin(), with_ledger.end());
  const int64_t max_without = *std::max_element(without.begin(), without.end());
  // Fair share is 240 / 8 = 30. Each router's ledger and the load reports keep
  // the hot worker within twice that; without the ledger, the routers see the
  // same stale loads between reports and pile onto it.
  std::printf("burst of 240 through 3 routers: at most %lld on one worker with the ledgers, %lld without\n",
              static_cast<long long>(max_with), static_cast<long long>(max_without));
  EXPECT_LE(max_with, 60) << "with the ledger";
  EXPECT_GT(max_without, max_with) << "without the ledger";
  const int64_t used = std::count_if(with_ledger.begin(), with_ledger.end(), [](int64_t n) { return n > 0; });
  EXPECT_EQ(used, cfg.workers);
}

}  // namespace
}  // namespace kvcache::router
