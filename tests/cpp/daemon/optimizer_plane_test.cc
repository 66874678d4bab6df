// OptimizerPlane as a data-parallel group's plane against two in-process
// "ranks": their rings live in ordinary memory, the test plays the clients'
// side of session_control.h. (The solo plane: optimizer_service_test.cc.)
#include "planes/optimizer_plane.h"

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "catch_compat.h"
#include "fp32_binding.h"
#include "planes/plane_common.h"
#include "sessions/param_binding.h"
#include "trainstream/optimizer/worker_pool.h"
#include "trainstream/wire/session_control.h"

using namespace trainstream;
using namespace trainstream::daemon;
using wire::CommandRecord;
using wire::CompletionRecord;
using wire::Opcode;
using wire::RingView;

namespace {

constexpr uint64_t kCapacity = 64;
constexpr size_t kNumel = 5;

// One rank's control region (header + both rings), as SessionRegistry lays it out.
struct FakeRank {
  FakeRank() {
    bytes = wire::ControlLayoutFor(kCapacity).bytes;
    memory = static_cast<char*>(::operator new (bytes, std::align_val_t{64}));
    std::memset(memory, 0, bytes);
    layout = wire::InitializeControlRegion(memory, 0, bytes, kCapacity);
    commands = RingView(memory + layout.command_ring_offset);
    completions = RingView(memory + layout.completion_ring_offset);
  }
  ~FakeRank() { ::operator delete (memory, std::align_val_t{64}); }
  // The daemon's copy of the layout (client_rings.h).
  ControlRings rings() const {
    return ControlRings{memory, layout.command_ring_offset, layout.completion_ring_offset,
                        kCapacity};
  }
  FakeRank(const FakeRank&) = delete;
  FakeRank& operator=(const FakeRank&) = delete;

  void Post(Opcode op, uint64_t step, double lr = 0.1, wire::StateField field = {}) {
    CommandRecord c = testing::AdamWCommand(op, step, lr);
    c.field = field;
    c.grads_posted = 1;
    REQUIRE(commands.TryPush(&c));
  }
  // The next completion (fails the test after 5 s).
  CompletionRecord Next() {
    CompletionRecord r{};
    REQUIRE(completions.Pop(&r, 5'000'000'000));
    return r;
  }

  char* memory = nullptr;
  size_t bytes = 0;
  wire::ControlLayout layout{};
  RingView commands, completions;
};

struct Fixture {
  Fixture() : pool(optimizer::WorkerPoolOptions{2, false}) {
    for (auto* v : {&master, &m, &v, &sum, &param_slot, &g0, &g1}) v->assign(kNumel, 0.f);
    for (size_t i = 0; i < kNumel; ++i) {
      param_slot[i] = static_cast<float>(i + 1);
      g0[i] = 1.0f + i;
      g1[i] = 3.0f - i;  // sums to 4 everywhere; rank 1's is negative for i > 2
    }
  }
  // `init`: local rank 0 initialises the masters from the slots, as a client's
  // registration does (DaemonBackend.register).
  void Start(const SessionOptimizerOptions& optimizer = {}, bool init = true) {
    ParamBinding b = testing::Fp32Binding(master, m, v, param_slot, &step_counter);
    b.rank_grads = {g0.data(), g1.data()};
    b.sum_slot = sum.data();
    std::vector<PlaneMember> members;
    members.push_back({0, 1, rank[0].rings(), nullptr});
    members.push_back({1, 2, rank[1].rings(), nullptr});
    PlaneOptions o;
    o.name = "group 'test'";
    o.group = true;
    o.world_size = 2;
    o.on_fault = [this](uint64_t session_id, const std::string& why) {
      std::lock_guard<std::mutex> lock(fault_mu);
      faults.emplace_back(session_id, why);
    };
    std::vector<ParamBinding> params;
    params.push_back(std::move(b));
    plane = std::make_unique<OptimizerPlane>(o, std::move(members), &pool);
    REQUIRE(plane->AddParameters(optimizer, std::move(params)).ok());
    if (init) Init();
  }
  void Init() {
    rank[0].Post(Opcode::kLoadState, 0, 0, wire::StateField::kParamFromSlot);
    REQUIRE(rank[0].Next().opcode == Opcode::kStateDone);
  }
  // The faults reported so far, once there is one (fails the test after 5 s).
  std::vector<std::pair<uint64_t, std::string>> Faults() {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    for (;;) {
      {
        std::lock_guard<std::mutex> lock(fault_mu);
        if (!faults.empty()) return faults;
      }
      REQUIRE(std::chrono::steady_clock::now() < deadline);
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  optimizer::WorkerPool pool;
  FakeRank rank[2];
  std::vector<float> master, m, v, sum, param_slot, g0, g1;
  uint64_t step_counter = 0;
  std::mutex fault_mu;
  std::vector<std::pair<uint64_t, std::string>> faults;  // Guarded by fault_mu.
  std::unique_ptr<OptimizerPlane> plane;  // last: stopped before the memory above goes
};

}  // namespace

TEST_CASE("Group: gradients of all ranks are averaged, updated once, announced to all", "[group]") {
  Fixture f;
  f.Start();
  for (int r = 0; r < 2; ++r) f.rank[r].Post(Opcode::kGradReady, 1);
  for (int r = 0; r < 2; ++r) f.rank[r].Post(Opcode::kStepEnd, 1);
  for (int r = 0; r < 2; ++r) {
    CompletionRecord a = f.rank[r].Next();
    CHECK(a.opcode == Opcode::kParamReady);
    CHECK(a.step == 1);
    CHECK(f.rank[r].Next().opcode == Opcode::kStepDone);
  }
  for (size_t i = 0; i < kNumel; ++i) {
    CHECK(f.sum[i] == 2.0f);  // (g0 + g1) / world_size
    // AdamW's first step moves every weight by lr * sign(gradient) (no decay here).
    CHECK(std::fabs(f.param_slot[i] - (static_cast<float>(i + 1) - 0.1f)) < 1e-5f);
  }
  CHECK(f.step_counter == 1);
}

TEST_CASE("Group: another rank's SYNC is answered once local rank 0 has written the weights",
          "[group]") {
  // Note [A member waits for the first weights]: the param slots are the group's, and
  // only local rank 0 writes the initial weights into them.
  Fixture f;
  f.Start({}, /*init=*/false);
  f.rank[1].Post(Opcode::kSync, 0);
  CompletionRecord early{};
  CHECK_FALSE(f.rank[1].completions.Pop(&early, 200'000'000));  // held: slots not written yet
  f.Init();
  CompletionRecord done = f.rank[1].Next();
  CHECK(done.opcode == Opcode::kSyncDone);
  for (size_t i = 0; i < kNumel; ++i) CHECK(f.master[i] == static_cast<float>(i + 1));
  // From then on a SYNC is answered at once.
  f.rank[1].Post(Opcode::kSync, 0);
  CHECK(f.rank[1].Next().opcode == Opcode::kSyncDone);
  f.rank[0].Post(Opcode::kSync, 0);
  CHECK(f.rank[0].Next().opcode == Opcode::kSyncDone);
}

TEST_CASE("Group: a member that keeps posting SYNCs before the first weights is ended", "[group]") {
  // Held SYNCs live in daemon memory (Note [A member waits for the first weights]):
  // past 64 per member the member is reported, never queued without bound.
  Fixture f;
  f.Start({}, /*init=*/false);
  for (int i = 0; i < 65; ++i) {
    // The plane drains the ring as it goes; wait for room rather than overrun it.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    CommandRecord c{};
    c.opcode = Opcode::kSync;
    while (!f.rank[1].commands.TryPush(&c)) {
      REQUIRE(std::chrono::steady_clock::now() < deadline);
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }
  const auto faults = f.Faults();
  REQUIRE(faults.size() == 1);
  CHECK(faults[0].first == 2);  // local rank 1's session
  CHECK(faults[0].second.find("SYNCs posted before the group's first weights") !=
        std::string::npos);
}

TEST_CASE("Group: ranks that disagree get GROUP_BROKEN naming the rank", "[group]") {
  Fixture f;
  f.Start();
  f.rank[0].Post(Opcode::kGradReady, 1, 0.1);
  f.rank[1].Post(Opcode::kGradReady, 1, 0.2);  // another learning rate
  for (int r = 0; r < 2; ++r) {
    CompletionRecord b = f.rank[r].Next();
    CHECK(b.opcode == Opcode::kGroupBroken);
    CHECK(std::string(b.message).find("local rank 1") != std::string::npos);
  }
  CHECK(!f.plane->failure().empty());
  // Later waits are answered, not left hanging.
  f.rank[0].Post(Opcode::kSync, 0);
  CHECK(f.rank[0].Next().opcode == Opcode::kGroupBroken);
}

TEST_CASE("Group: Stop tells every rank but the leaver, and drains a half-done step", "[group]") {
  Fixture f;
  f.Start();
  f.rank[0].Post(Opcode::kGradReady, 1);
  f.rank[1].Post(Opcode::kGradReady, 1);
  f.rank[0].Post(Opcode::kStepEnd, 1);  // rank 1 "dies" before its STEP_END
  CHECK(f.rank[0].Next().opcode == Opcode::kParamReady);
  f.plane->Stop("local rank 1 (pid 7) left: client process exited", 1);
  CompletionRecord b = f.rank[0].Next();
  CHECK(b.opcode == Opcode::kGroupBroken);  // not a STEP_DONE for the unfinished step
  CHECK(std::string(b.message).find("local rank 1 (pid 7) left") != std::string::npos);
  CompletionRecord c{};
  while (f.rank[1].completions.TryPop(&c)) CHECK(c.opcode != Opcode::kGroupBroken);  // not told
}

TEST_CASE("Group: a member whose ring is corrupt is reported by its session id", "[group]") {
  Fixture f;
  f.Start();
  // Local rank 1 (session 2) pushes its tail 2^40 records ahead (client_rings.h).
  auto* h = reinterpret_cast<wire::RingHeader*>(f.rank[1].rings().command_ring());
  h->tail.store(uint64_t{1} << 40);
  const auto faults = f.Faults();
  REQUIRE(faults.size() == 1);
  CHECK(faults[0].first == 2);
  CHECK(faults[0].second.find("command ring corrupt") != std::string::npos);
}

TEST_CASE("Group: the engine runs on `threads` workers, as a solo session's does", "[group]") {
  // Groups dropped RegisterParameters.threads once (the registries each had
  // their own request-to-binding code); both now go through BindState
  // (Note [One path for sessions and groups]).
  v1::RegisterParametersRequest req;
  req.set_threads(1);
  req.set_seed(3);
  const RegistrationLayout layout = ComputeRegistrationLayout(req, 2, /*sum_slot=*/true);
  std::vector<char> state(layout.state_bytes);
  const SessionOptimizerOptions options =
      BindState(WriteState(state.data(), layout, req), state.data(), nullptr).options;
  CHECK(options.threads == 1);
  CHECK(options.seed == 3);
  Fixture f;
  REQUIRE(f.pool.size() == 2);
  f.Start(options);
  CHECK(f.plane->engine_workers() == 1);
  // And it still trains: one averaged update, announced to both ranks.
  for (int r = 0; r < 2; ++r) f.rank[r].Post(Opcode::kGradReady, 1);
  for (int r = 0; r < 2; ++r) f.rank[r].Post(Opcode::kStepEnd, 1);
  for (int r = 0; r < 2; ++r) {
    CHECK(f.rank[r].Next().opcode == Opcode::kParamReady);
    CHECK(f.rank[r].Next().opcode == Opcode::kStepDone);
  }
  CHECK(f.step_counter == 1);
}

TEST_CASE("Group: without `threads` the engine uses the whole pool", "[group]") {
  Fixture f;
  f.Start();
  CHECK(f.plane->engine_workers() == f.pool.size());
}

TEST_CASE("BindState: a group's layout binds every rank's slot, the sum and the options",
          "[group]") {
  v1::RegisterParametersRequest req;
  req.set_threads(1);
  req.set_max_grad_norm(1.5);
  auto* p = req.add_params();
  p->set_param_id(9);
  p->set_name("w");
  p->add_shape(static_cast<int64_t>(kNumel));
  p->set_dtype(v1::DTYPE_BFLOAT16);
  const RegistrationLayout layout = ComputeRegistrationLayout(req, 2, /*sum_slot=*/true);
  std::vector<char> state(layout.state_bytes), staging(layout.staging_bytes);
  const PlaneRegistration r =
      BindState(WriteState(state.data(), layout, req), state.data(), staging.data());
  CHECK(r.options.threads == 1);
  CHECK(r.options.max_grad_norm == 1.5);
  CHECK(r.options.moment_dtype == wire::DType::kFloat32);  // unspecified: fp32
  REQUIRE(r.params.size() == 1);
  const ParamBinding& b = r.params[0];
  const ParamPlacement& pl = layout.params[0];
  CHECK(b.param_id == 9);
  CHECK(b.grad_dtype == wire::DType::kBFloat16);  // unspecified: the param's
  CHECK(b.grad_slot == nullptr);
  REQUIRE(b.rank_grads.size() == 2);
  CHECK(b.rank_grads[1] == staging.data() + pl.grad_offset + pl.grad_stride);
  CHECK(reinterpret_cast<char*>(b.sum_slot) == staging.data() + pl.sum_offset);
  CHECK(reinterpret_cast<char*>(b.durable.torch_step) > state.data());
  CHECK(b.durable.record == nullptr);  // no recovery records asked for

  const RegistrationLayout solo = ComputeRegistrationLayout(req);
  std::vector<char> state1(solo.state_bytes), staging1(solo.staging_bytes);
  const PlaneRegistration s =
      BindState(WriteState(state1.data(), solo, req), state1.data(), staging1.data());
  CHECK(s.options.threads == 1);
  CHECK(s.params[0].grad_slot == staging1.data() + solo.params[0].grad_offset);
  CHECK(s.params[0].rank_grads.empty());
  CHECK(s.params[0].sum_slot == nullptr);
}

TEST_CASE("SumRankGradients: small and pool-split sums are the mean of every rank's slot",
          "[group]") {
  optimizer::WorkerPool pool(optimizer::WorkerPoolOptions{2, false});
  for (size_t n : {size_t{5}, size_t{1} << 19}) {  // below and above the split size
    std::vector<float> a(n), b(n), c(n), sum(n, -1.f);
    for (size_t i = 0; i < n; ++i) {
      a[i] = static_cast<float>(i % 7);
      b[i] = 1.0f;
      c[i] = -static_cast<float>(i % 3);
    }
    SumRankGradients({a.data(), b.data(), c.data()}, kernels::DType::kFloat32, sum.data(), n, 4.0f,
                     &pool);
    size_t wrong = 0;
    for (size_t i = 0; i < n; ++i) wrong += sum[i] != (a[i] + b[i] + c[i]) / 4.0f;
    CHECK(wrong == 0);
  }
}

TEST_CASE("a solo plane streams gradients through its pool and refuses bad extents",
          "[plane][grad_pool]") {
  // Note [A pool extent a client names]: pooled GRAD_READYs name (pos, len); the
  // plane updates from those bytes, frees them before PARAM_READY, and answers a
  // bad extent with ERROR while the session goes on.
  optimizer::WorkerPool pool(optimizer::WorkerPoolOptions{2, false});
  FakeRank client;
  constexpr uint64_t kCap = 4096;
  std::vector<char> staging(wire::kGradPoolOffset + kCap);
  auto gp = std::make_unique<GradientPool>(staging.data(), wire::kGradPoolOffset, kCap, true);
  std::vector<float> master(kNumel), m(kNumel), v(kNumel), slot(kNumel, 1.0f);
  uint64_t torch_step = 0;
  ParamBinding b = testing::Fp32Binding(master, m, v, slot, &torch_step);
  b.pool = gp.get();
  std::vector<PlaneMember> members;
  members.push_back({0, 1, client.rings(), nullptr});
  PlaneOptions o;
  o.name = "session 1";
  OptimizerPlane plane(o, std::move(members), &pool);
  std::vector<ParamBinding> params;
  params.push_back(std::move(b));
  REQUIRE(plane.AddParameters({}, std::move(params), false, {}, std::move(gp)).ok());
  client.Post(Opcode::kLoadState, 0, 0, wire::StateField::kParamFromSlot);
  REQUIRE(client.Next().opcode == Opcode::kStateDone);
  auto* header =
      reinterpret_cast<wire::GradPoolHeader*>(staging.data() + wire::kGradPoolHeaderOffset);
  auto grad = [&](uint64_t step, uint64_t pos, uint64_t len, uint32_t flags) {
    CommandRecord c = testing::AdamWCommand(Opcode::kGradReady, step);
    c.flags = flags;
    c.seq = step;
    c.region_offset = pos;
    c.bytes = len;
    REQUIRE(client.commands.TryPush(&c));
  };
  const uint64_t len = kNumel * 4;
  for (uint64_t step = 1; step <= 3; ++step) {
    const uint64_t pos = (step - 1) * 1000 * 64;  // a new place every step
    float* g = reinterpret_cast<float*>(staging.data() + wire::kGradPoolOffset + pos % kCap);
    for (size_t i = 0; i < kNumel; ++i) g[i] = 1.0f;
    grad(step, pos, len, wire::kFlagPooledGrad);
    CompletionRecord r = client.Next();
    REQUIRE(r.opcode == Opcode::kParamReady);
    CHECK(header->released.load() == pos + len);  // freed before PARAM_READY
    client.Post(Opcode::kStepEnd, step);
    REQUIRE(client.Next().opcode == Opcode::kStepDone);
  }
  CHECK(slot[0] < 1.0f);                        // three updates with positive gradients
  grad(4, 64, len + 4, wire::kFlagPooledGrad);  // the wrong length
  CompletionRecord r = client.Next();
  CHECK(r.opcode == Opcode::kError);
  CHECK(std::string(r.message).find("its gradient has") != std::string::npos);
  grad(4, 64, len, 0);  // no extent named for a pooled param
  r = client.Next();
  CHECK(r.opcode == Opcode::kError);
  CHECK(std::string(r.message).find("gradient pool") != std::string::npos);
  grad(4, 128, len, wire::kFlagPooledGrad);  // still served
  CHECK(client.Next().opcode == Opcode::kParamReady);
  plane.Stop("", -1);
}
