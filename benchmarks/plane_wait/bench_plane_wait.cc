// trainstream-bench-plane-wait: command round trip and idle CPU of the ways an
// optimizer plane can wait for commands (Note [How the plane waits],
// daemon/planes/optimizer_plane.cc).
//   futex-slice  the solo plane's old loop: a futex pop on its one ring, 20 ms
//                slices (it cannot watch a second ring)
//   backoff      the group plane's old loop: every ring in turn, then 200
//                yields, 50 us sleeps, 500 us sleeps after ~0.1 s idle
//   plane        the OptimizerPlane as built (solo for 1 ring, a group for 2)
// Each runs against in-process rings (the client side is wire::RingView, as the
// Python client's) answering SYNC. Figures: the median round trip of SYNCs sent
// back to back and after idle gaps of 1 ms and 20 ms, and the process's CPU
// while no command comes (2 s, in % of one core). With --runs N every figure is
// the median over N runs: the machine may be shared, so look at medians.
#include <spdlog/spdlog.h>
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "planes/client_rings.h"
#include "planes/optimizer_plane.h"
#include "trainstream/optimizer/worker_pool.h"
#include "trainstream/wire/session_control.h"

namespace {

using namespace trainstream;
using namespace trainstream::daemon;
using Clock = std::chrono::steady_clock;
using wire::CommandRecord;
using wire::CompletionRecord;
using wire::Opcode;

constexpr uint64_t kCapacity = 4096;

struct Region {
  Region() {
    bytes = wire::ControlLayoutFor(kCapacity).bytes;
    memory = static_cast<char*>(std::aligned_alloc(64, bytes));
    std::memset(memory, 0, bytes);
    const wire::ControlLayout l = wire::InitializeControlRegion(memory, 0, bytes, kCapacity);
    rings = ControlRings{memory, l.command_ring_offset, l.completion_ring_offset, kCapacity};
    commands = wire::RingView(rings.command_ring());
    completions = wire::RingView(rings.completion_ring());
  }
  ~Region() { std::free(memory); }
  Region(const Region&) = delete;
  Region& operator=(const Region&) = delete;
  char* memory = nullptr;
  uint64_t bytes = 0;
  ControlRings rings;
  wire::RingView commands, completions;
};

// A hand-written consumer (the two old loops): answers SYNC with SYNC_DONE.
class EchoServer {
 public:
  EchoServer(std::vector<Region*> regions, bool futex) {
    for (Region* r : regions) {
      commands_.emplace_back(r->rings.command_ring(), kCapacity);
      completions_.emplace_back(r->rings.completion_ring(), kCapacity);
    }
    thread_ = std::thread([this, futex] { futex ? FutexLoop() : BackoffLoop(); });
  }
  ~EchoServer() {
    stop_ = true;
    for (auto& c : commands_) c.Wake();
    thread_.join();
  }
  EchoServer(const EchoServer&) = delete;
  EchoServer& operator=(const EchoServer&) = delete;

 private:
  void Answer(size_t r, const CommandRecord& cmd) {
    CompletionRecord rec{};
    rec.opcode = Opcode::kSyncDone;
    rec.seq = cmd.seq;
    completions_[r].Push(rec);
  }
  void FutexLoop() {  // the old solo loop (one ring)
    CommandRecord cmd{};
    while (!stop_) {
      completions_[0].Flush();
      if (commands_[0].Pop(&cmd, 20'000'000) == RingResult::kOk) Answer(0, cmd);
    }
  }
  void BackoffLoop() {  // the old group loop
    int idle = 0;
    CommandRecord cmd{};
    while (!stop_) {
      bool any = false;
      for (size_t r = 0; r < commands_.size(); ++r) {
        completions_[r].Flush();
        for (int n = 0; n < 64 && commands_[r].TryPop(&cmd) == RingResult::kOk; ++n) {
          Answer(r, cmd);
          any = true;
        }
      }
      if (any) {
        idle = 0;
        continue;
      }
      if (idle <= 200 + 2000) ++idle;
      if (idle < 200) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(idle > 2200 ? 500 : 50));
      }
    }
  }
  std::atomic<bool> stop_{false};
  std::vector<CommandConsumer> commands_;
  std::vector<CompletionQueue> completions_;
  std::thread thread_;
};

// The real plane, with one tiny parameter so SYNC reaches the engine.
class PlaneServer {
 public:
  PlaneServer(std::vector<Region*> regions, optimizer::WorkerPool* pool) {
    for (auto* v : {&master_, &m_, &v_, &param_, &sum_}) v->assign(16, 0.f);
    PlaneOptions o;
    o.name = "bench";
    o.group = regions.size() > 1;
    o.world_size = static_cast<uint32_t>(regions.size());
    std::vector<PlaneMember> members;
    ParamBinding b;
    b.numel = 16;
    b.master = master_.data();
    b.exp_avg = m_.data();
    b.exp_avg_sq = v_.data();
    b.param_slot = param_.data();
    grads_.resize(regions.size());
    for (size_t r = 0; r < regions.size(); ++r) {
      members.push_back(PlaneMember{static_cast<int32_t>(r), r + 1, regions[r]->rings, nullptr});
      grads_[r].assign(16, 0.f);
      b.rank_grads.push_back(grads_[r].data());
    }
    if (o.group) {
      b.sum_slot = sum_.data();
    } else {
      b.grad_slot = grads_[0].data();
      b.rank_grads.clear();
    }
    plane_ = std::make_unique<OptimizerPlane>(o, std::move(members), pool);
    std::vector<ParamBinding> params;
    params.push_back(std::move(b));
    plane_->AddParameters({}, std::move(params));
  }

 private:
  std::vector<float> master_, m_, v_, param_, sum_;
  std::vector<std::vector<float>> grads_;
  std::unique_ptr<OptimizerPlane> plane_;  // last: stopped first
};

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double CpuSeconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1e-6;
}

// One SYNC round trip on `region`, in microseconds.
double RoundTrip(Region& region, uint64_t seq) {
  CommandRecord c{};
  c.opcode = Opcode::kSync;
  c.seq = seq;
  const auto t0 = Clock::now();
  while (!region.commands.TryPush(&c)) std::this_thread::yield();
  CompletionRecord r{};
  for (;;) {
    if (!region.completions.Pop(&r, 5'000'000'000)) {
      std::fprintf(stderr, "no answer within 5 s\n");
      std::exit(1);
    }
    if (r.opcode == Opcode::kSyncDone && r.seq == seq) break;
  }
  return std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
}

struct Figures {
  double hot_us = 0, gap1ms_us = 0, gap20ms_us = 0, idle_cpu_pct = 0;
};

Figures Measure(std::vector<Region*> regions) {
  Figures f;
  uint64_t seq = 1;
  std::vector<double> hot, gap1, gap20;
  for (int i = 0; i < 2000; ++i) hot.push_back(RoundTrip(*regions[i % regions.size()], seq++));
  for (int i = 0; i < 200; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    gap1.push_back(RoundTrip(*regions[i % regions.size()], seq++));
  }
  for (int i = 0; i < 40; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    gap20.push_back(RoundTrip(*regions[i % regions.size()], seq++));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // into the long idle
  const double c0 = CpuSeconds();
  const auto t0 = Clock::now();
  std::this_thread::sleep_for(std::chrono::seconds(2));
  const double wall = std::chrono::duration<double>(Clock::now() - t0).count();
  f.idle_cpu_pct = 100.0 * (CpuSeconds() - c0) / wall;
  if (std::getenv("BENCH_PLANE_WAIT_DEBUG") != nullptr) {
    std::sort(hot.begin(), hot.end());
    std::fprintf(stderr, "hot: min %.2f p10 %.2f p50 %.2f p90 %.2f max %.2f\n", hot.front(),
                 hot[hot.size() / 10], hot[hot.size() / 2], hot[hot.size() * 9 / 10], hot.back());
  }
  f.hot_us = Median(hot);
  f.gap1ms_us = Median(gap1);
  f.gap20ms_us = Median(gap20);
  return f;
}

}  // namespace

int main(int argc, char** argv) {
  int runs = 5;
  std::string only;  // --only NAME: one strategy
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--runs") == 0 && i + 1 < argc) runs = std::atoi(argv[++i]);
    if (std::strcmp(argv[i], "--only") == 0 && i + 1 < argc) only = argv[++i];
  }
  spdlog::set_level(spdlog::level::off);
  optimizer::WorkerPool pool(optimizer::WorkerPoolOptions{2, false});
  struct Case {
    std::string name;
    size_t rings;
    std::function<std::shared_ptr<void>(std::vector<Region*>)> start;
  };
  const std::vector<Case> cases = {
      {"futex-slice", 1,
       [](std::vector<Region*> r) { return std::make_shared<EchoServer>(r, true); }},
      {"backoff", 1, [](std::vector<Region*> r) { return std::make_shared<EchoServer>(r, false); }},
      {"plane", 1,
       [&pool](std::vector<Region*> r) { return std::make_shared<PlaneServer>(r, &pool); }},
      {"backoff", 2, [](std::vector<Region*> r) { return std::make_shared<EchoServer>(r, false); }},
      {"plane", 2,
       [&pool](std::vector<Region*> r) { return std::make_shared<PlaneServer>(r, &pool); }},
  };
  std::printf("%-12s %5s %10s %10s %10s %10s   (median of %d runs; round trips in us)\n",
              "strategy", "rings", "hot", "gap 1ms", "gap 20ms", "idle CPU%", runs);
  for (const Case& c : cases) {
    if (!only.empty() && c.name != only) continue;
    std::vector<double> hot, g1, g20, cpu;
    for (int run = 0; run < runs; ++run) {
      std::vector<std::unique_ptr<Region>> regions;
      std::vector<Region*> raw;
      for (size_t i = 0; i < c.rings; ++i) {
        regions.push_back(std::make_unique<Region>());
        raw.push_back(regions.back().get());
      }
      std::shared_ptr<void> server = c.start(raw);
      const Figures f = Measure(raw);
      server.reset();
      hot.push_back(f.hot_us);
      g1.push_back(f.gap1ms_us);
      g20.push_back(f.gap20ms_us);
      cpu.push_back(f.idle_cpu_pct);
    }
    std::printf("%-12s %5zu %10.1f %10.1f %10.1f %10.2f\n", c.name.c_str(), c.rings, Median(hot),
                Median(g1), Median(g20), Median(cpu));
    std::fflush(stdout);
  }
  return 0;
}
