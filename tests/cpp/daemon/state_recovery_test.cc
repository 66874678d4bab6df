// Note [Optimizer state outlives the daemon]: a process running the engine on
// durable state is SIGKILLed at random moments (often in the middle of a
// sub-chunk); CompleteUpdates then makes the state whole, a new engine adopts it
// and trains on, and the result must be bit for bit an uninterrupted run's. The
// parameters have one dtype each, so every master layout is journaled: a split
// bf16 master (its high halves in the staging segment), an fp32 weight slot
// that is its own master, and an fp16 weight's separate fp32 master (Note [One
// host copy of a trained weight], trainstream/wire/segment_header.h).
#include "recovery/state_recovery.h"

#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "catch_compat.h"
#include "planes/optimizer_plane.h"
#include "sessions/param_binding.h"
#include "sessions/param_layout.h"
#include "trainstream/kernels/bf16.h"
#include "trainstream/optimizer/adamw_engine.h"
#include "trainstream/optimizer/worker_pool.h"

using namespace trainstream;
using namespace trainstream::daemon;
namespace wire = trainstream::wire;

namespace {

constexpr uint64_t kSteps = 6;
constexpr uint64_t kSeed = 5;
const std::vector<int64_t> kSizes = {300000, 70001, 5};
const std::vector<v1::DType> kDTypes = {v1::DTYPE_BFLOAT16, v1::DTYPE_FLOAT32, v1::DTYPE_FLOAT16};
const kernels::AdamWHyperParams kHp{1e-2, 0.9, 0.999, 1e-8, 0.01};

float Grad(uint64_t step, size_t param, size_t i) {
  return std::sin(0.37f * static_cast<float>(step) + 1.3f * static_cast<float>(param) +
                  0.001f * static_cast<float>(i));
}
float Weight0(size_t param, size_t i) {
  return std::cos(static_cast<float>(param) + 0.01f * static_cast<float>(i));
}

void* Shared(size_t bytes) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  REQUIRE(p != MAP_FAILED);
  return p;
}

struct Case {
  wire::DType moment = wire::DType::kFloat32;
  double max_grad_norm = 0;
};

v1::RegisterParametersRequest Request(const Case& c) {
  v1::RegisterParametersRequest req;
  auto* g = req.add_groups();
  g->set_lr(kHp.lr);
  g->set_beta1(kHp.beta1);
  g->set_beta2(kHp.beta2);
  g->set_eps(kHp.eps);
  g->set_weight_decay(kHp.weight_decay);
  req.set_moment_dtype(static_cast<v1::DType>(c.moment));
  req.set_max_grad_norm(c.max_grad_norm);
  req.set_seed(kSeed);
  for (size_t i = 0; i < kSizes.size(); ++i) {
    auto* p = req.add_params();
    p->set_param_id(10 + i);
    p->set_name("p" + std::to_string(i));
    p->add_shape(kSizes[i]);
    p->set_dtype(kDTypes[i]);
    p->set_grad_dtype(v1::DTYPE_FLOAT32);
  }
  return req;
}

// The engine's binding of a plane's (a solo session's) parameter.
optimizer::ParamBinding EngineBinding(const ParamBinding& b) {
  optimizer::ParamBinding eb;
  eb.param_id = b.param_id;
  eb.numel = b.numel;
  eb.param_dtype = b.param_dtype;
  eb.grad_dtype = b.grad_dtype;
  eb.master = b.master;
  eb.master_lo = b.master_lo;
  eb.exp_avg = b.exp_avg;
  eb.exp_avg_sq = b.exp_avg_sq;
  eb.grad_slot = b.grad_slot;
  eb.param_slot = b.param_slot;
  eb.durable = b.durable;
  return eb;
}

// Writes parameter p's initial weights into its slot, in its dtype.
void WriteWeights(void* slot, size_t p) {
  for (int64_t i = 0; i < kSizes[p]; ++i) {
    const float w = Weight0(p, static_cast<size_t>(i));
    if (kDTypes[p] == v1::DTYPE_FLOAT32) {
      static_cast<float*>(slot)[i] = w;
    } else {
      static_cast<uint16_t*>(slot)[i] = kDTypes[p] == v1::DTYPE_BFLOAT16
                                            ? kernels::FloatToBf16Rne(w)
                                            : kernels::FloatToFp16Rne(w);
    }
  }
}

optimizer::EngineOptions Options(const Case& c) {
  optimizer::EngineOptions eo;
  eo.moment_dtype = c.moment;
  eo.max_grad_norm = c.max_grad_norm;
  eo.seed = kSeed;
  eo.chunk_elems = kPlaneChunkElems;
  return eo;
}

// One registration's memory, shared with a child process.
struct Memory {
  RegistrationLayout layout;
  char* state = nullptr;
  char* staging = nullptr;
  std::atomic<uint64_t>* progress = nullptr;  // the step the child is on

  Memory(const v1::RegisterParametersRequest& req, uint32_t slots) {
    RecoveryLayoutOptions rec{true, kPlaneChunkElems, slots};
    layout = ComputeRegistrationLayout(req, 1, false, rec);
    state = static_cast<char*>(Shared(layout.state_bytes));
    staging = static_cast<char*>(Shared(layout.staging_bytes));
    progress = new (Shared(4096)) std::atomic<uint64_t>(0);
    reinterpret_cast<wire::SegmentHeader*>(state)->magic = wire::kSegmentMagic;
    reinterpret_cast<wire::SegmentHeader*>(state)->version = wire::kSegmentVersion;
    reinterpret_cast<wire::SegmentHeader*>(state)->total_bytes = layout.state_bytes;
  }
  ~Memory() {
    munmap(state, layout.state_bytes);
    munmap(staging, layout.staging_bytes);
    munmap(progress, 4096);
  }
  float* GradSlot(size_t p) {
    return reinterpret_cast<float*>(staging + layout.params[p].grad_offset);
  }
  void* ParamSlot(size_t p) { return staging + layout.params[p].param_offset; }
};

void WriteGrads(float* const* slots, uint64_t step, const std::vector<size_t>& params) {
  for (size_t p : params)
    for (int64_t i = 0; i < kSizes[p]; ++i) slots[p][i] = Grad(step, p, static_cast<size_t>(i));
}

// The child: registers (as RegisterParameters + kParamFromSlot do) and trains
// kSteps steps, telling the parent which step it is on. Never returns.
[[noreturn]] void Train(const Case& c, Memory* mem, const v1::RegisterParametersRequest& req) {
  RecoveryOwner owner;
  owner.staging_name = "trainstream-test";
  owner.staging_bytes = mem->layout.staging_bytes;
  PlaneRegistration reg =
      BindState(WriteState(mem->state, mem->layout, req, &owner), mem->state, mem->staging);
  optimizer::WorkerPool pool(optimizer::WorkerPoolOptions{2, false});
  optimizer::AdamWEngine engine(&pool, Options(c));
  std::vector<float*> grads;
  for (size_t p = 0; p < kSizes.size(); ++p) {
    WriteWeights(mem->ParamSlot(p), p);
    if (!engine.AddParam(EngineBinding(reg.params[p])).ok()) _exit(3);
    grads.push_back(mem->GradSlot(p));
  }
  if (!engine.Init().ok()) _exit(4);
  for (uint64_t s = 1; s <= kSteps; ++s) {
    WriteGrads(grads.data(), s, {0, 1, 2});
    mem->progress->store(s);
    for (size_t p = 0; p < kSizes.size(); ++p)
      if (!engine.SubmitGrad(10 + p, s, kHp).ok()) _exit(5);
    if (!engine.StepEnd(s).ok()) _exit(6);
    engine.WaitIdle();
  }
  _exit(0);
}

// An uninterrupted run's state after kSteps: a registration laid out the same
// way, trained without durable records.
struct Reference {
  std::unique_ptr<Memory> mem;
  explicit Reference(const Case& c) {
    const v1::RegisterParametersRequest req = Request(c);
    mem = std::make_unique<Memory>(req, 2);
    PlaneRegistration reg =
        BindState(WriteState(mem->state, mem->layout, req), mem->state, mem->staging);
    optimizer::WorkerPool pool(optimizer::WorkerPoolOptions{2, false});
    optimizer::AdamWEngine engine(&pool, Options(c));
    std::vector<float*> grads;
    for (size_t p = 0; p < kSizes.size(); ++p) {
      WriteWeights(mem->ParamSlot(p), p);
      REQUIRE(engine.AddParam(EngineBinding(reg.params[p])).ok());
      grads.push_back(mem->GradSlot(p));
    }
    REQUIRE(engine.Init().ok());
    for (uint64_t s = 1; s <= kSteps; ++s) {
      WriteGrads(grads.data(), s, {0, 1, 2});
      for (size_t p = 0; p < kSizes.size(); ++p) REQUIRE(engine.SubmitGrad(10 + p, s, kHp).ok());
      REQUIRE(engine.StepEnd(s).ok());
      engine.WaitIdle();
    }
  }
};

struct Totals {
  int runs = 0, killed_mid_step = 0, recovery_killed = 0;
  uint64_t restored = 0, rolled = 0, replayed = 0;
};

// Kills a training child at a random moment, recovers (sometimes killing a
// first recovery too), trains on to kSteps in a new engine, compares.
void OneRun(const Case& c, const Reference& ref, std::mt19937* rng, Totals* totals) {
  const v1::RegisterParametersRequest req = Request(c);
  Memory mem(req, 2);
  pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) Train(c, &mem, req);
  const uint64_t target = std::uniform_int_distribution<uint64_t>(1, kSteps)(*rng);
  const int delay_us = std::uniform_int_distribution<int>(0, 4000)(*rng);
  int status = 0;
  bool reaped = false;
  while (mem.progress->load() < target && !reaped) {
    reaped = waitpid(child, &status, WNOHANG) == child;
    usleep(20);
  }
  if (!reaped) {
    usleep(static_cast<useconds_t>(delay_us));
    kill(child, SIGKILL);
    waitpid(child, &status, 0);
  }
  if (WIFEXITED(status)) REQUIRE(WEXITSTATUS(status) == 0);  // finished before the kill
  ++totals->runs;

  StateSegmentView view;
  trainstream::Status checked = CheckStateSegment(mem.state, mem.layout.state_bytes, &view);
  if (!checked.ok()) {
    // Killed before Init finished: not adoptable, as a registration in flight.
    REQUIRE(checked.message().find("not initialised") != std::string::npos);
    return;
  }
  if (std::uniform_int_distribution<int>(0, 2)(*rng) == 0) {
    // A daemon killed while it recovers: the next one must still get it right.
    pid_t again = fork();
    REQUIRE(again >= 0);
    if (again == 0) {
      CompleteUpdates(view, mem.staging, mem.layout.staging_bytes, CurrentStepRecord(view));
      _exit(0);
    }
    usleep(static_cast<useconds_t>(std::uniform_int_distribution<int>(0, 300)(*rng)));
    kill(again, SIGKILL);
    waitpid(again, nullptr, 0);
    ++totals->recovery_killed;
  }
  const RecoveryReport report =
      CompleteUpdates(view, mem.staging, mem.layout.staging_bytes, CurrentStepRecord(view));
  REQUIRE(report.lost.empty());
  totals->restored += report.restored_subchunks;
  totals->rolled += report.rolled_forward;
  std::vector<uint64_t> applied;
  for (const ParamOutcome& o : report.params) {
    REQUIRE(!o.skipped);
    REQUIRE(o.torch_step == o.applied_step);
    applied.push_back(o.applied_step);
  }
  if (c.max_grad_norm > 0) {
    // A clipped step lands on every parameter or on none.
    for (uint64_t a : applied) CHECK(a == applied[0]);
  }
  const uint64_t low = *std::min_element(applied.begin(), applied.end());
  if (low < kSteps && *std::max_element(applied.begin(), applied.end()) != low)
    ++totals->killed_mid_step;

  // A new engine adopts the state and trains on.
  optimizer::WorkerPool pool(optimizer::WorkerPoolOptions{2, false});
  optimizer::AdamWEngine engine(&pool, Options(c));
  std::vector<float*> grads;
  // Bound as the session registry binds an adopted state.
  PlaneRegistration adopted = BindState(view, mem.state, mem.staging, /*adopted=*/true);
  for (size_t p = 0; p < view.params.size(); ++p) {
    const CheckedParam& cp = view.params[p];
    CHECK(cp.master_layout == wire::MasterLayoutFor(static_cast<wire::DType>(kDTypes[p])));
    REQUIRE(engine.AddParam(EngineBinding(adopted.params[p])).ok());
    grads.push_back(reinterpret_cast<float*>(mem.staging + cp.grad_offset));
  }
  REQUIRE(engine.AdoptInitialized().ok());
  for (uint64_t s = low + 1; s <= kSteps; ++s) {
    std::vector<size_t> due;
    for (size_t p = 0; p < applied.size(); ++p)
      if (applied[p] < s) due.push_back(p);
    totals->replayed += s == low + 1 ? due.size() : 0;
    WriteGrads(grads.data(), s, due);
    for (size_t p : due) REQUIRE(engine.SubmitGrad(10 + p, s, kHp).ok());
    REQUIRE(engine.StepEnd(s).ok());
    engine.WaitIdle();
  }
  const size_t mb = wire::DTypeSize(c.moment);
  const Memory& want = *ref.mem;
  for (size_t p = 0; p < view.params.size(); ++p) {
    const CheckedParam& cp = view.params[p];
    const size_t n = cp.numel;
    // The master wherever it is: its state array (if any) and the weight slot.
    const uint64_t master_bytes = n * wire::MasterStateBytes(cp.master_layout);
    CHECK(std::memcmp(mem.state + cp.master_offset, want.state + cp.master_offset, master_bytes) ==
          0);
    CHECK(std::memcmp(mem.staging + cp.param_offset, want.staging + cp.param_offset,
                      n * wire::DTypeSize(cp.dtype)) == 0);
    CHECK(std::memcmp(mem.state + cp.exp_avg_offset, want.state + cp.exp_avg_offset, n * mb) == 0);
    CHECK(std::memcmp(mem.state + cp.exp_avg_sq_offset, want.state + cp.exp_avg_sq_offset,
                      n * mb) == 0);
    CHECK(*reinterpret_cast<uint64_t*>(mem.state + cp.step_offset) == kSteps);
  }
}

void KillLoop(const Case& c, uint32_t seed) {
  const Reference ref(c);
  std::mt19937 rng(seed);
  Totals totals;
  // Until the kills have landed inside updates often enough to exercise both
  // repairs, within a bound (each run takes some milliseconds). A kill lands
  // between a redo record's `valid` and its progress (a cache-to-cache copy) in
  // about one run of 50 to 100 here.
  while (totals.runs < 2000 &&
         (totals.runs < 20 || totals.restored < 2 || totals.rolled < 2 ||
          (c.max_grad_norm == 0 && totals.killed_mid_step < 2) || totals.recovery_killed < 2)) {
    OneRun(c, ref, &rng, &totals);
  }
  WARN("runs " << totals.runs << ", sub-chunks restored " << totals.restored
               << ", parameters rolled forward " << totals.rolled << ", replayed "
               << totals.replayed);
  CHECK(totals.restored >= 2);
  CHECK(totals.rolled >= 2);
  CHECK(totals.recovery_killed >= 2);
}

}  // namespace

TEST_CASE("SIGKILL mid-update, fp32 moments: recovered and trained on, bit-identical",
          "[recovery]") {
  KillLoop(Case{wire::DType::kFloat32, 0}, 1);
}

TEST_CASE("SIGKILL mid-update, bf16 moments (stochastic rounding): bit-identical", "[recovery]") {
  KillLoop(Case{wire::DType::kBFloat16, 0}, 2);
}

TEST_CASE("SIGKILL mid-update with clipping: a step lands on every parameter or none",
          "[recovery]") {
  KillLoop(Case{wire::DType::kFloat32, 0.5}, 3);
}

TEST_CASE("A manifest entry whose master layout does not fit its dtype is refused", "[recovery]") {
  // Note [One host copy of a trained weight]: the layout decides where the engine
  // reads and writes the master, so one that the entry's dtype does not have (a split
  // master of fp32 weights, an fp32 weight slot master with a state array) is hostile.
  const Case c;
  const v1::RegisterParametersRequest req = Request(c);
  Memory mem(req, 2);
  RecoveryOwner owner;
  owner.staging_name = "trainstream-test";
  owner.staging_bytes = mem.layout.staging_bytes;
  PlaneRegistration reg =
      BindState(WriteState(mem.state, mem.layout, req, &owner), mem.state, mem.staging);
  optimizer::WorkerPool pool(optimizer::WorkerPoolOptions{2, false});
  {
    optimizer::AdamWEngine engine(&pool, Options(c));
    for (size_t p = 0; p < kSizes.size(); ++p) {
      WriteWeights(mem.ParamSlot(p), p);
      REQUIRE(engine.AddParam(EngineBinding(reg.params[p])).ok());
    }
    REQUIRE(engine.Init().ok());
  }
  StateSegmentView view;
  REQUIRE(CheckStateSegment(mem.state, mem.layout.state_bytes, &view).ok());
  auto* entries = reinterpret_cast<wire::StateManifestEntry*>(
      mem.state + mem.layout.manifest_offset + sizeof(wire::StateManifest));
  // Entry 1 is the fp32 parameter: its slot is its master.
  REQUIRE(entries[1].master_layout == static_cast<uint32_t>(wire::MasterLayout::kWeightSlot));
  entries[1].master_layout = static_cast<uint32_t>(wire::MasterLayout::kSplitBf16);
  trainstream::Status st = CheckStateSegment(mem.state, mem.layout.state_bytes, &view);
  CHECK(st.message().find("entry 1: master layout") != std::string::npos);
  entries[1].master_layout = 7;
  CHECK(!CheckStateSegment(mem.state, mem.layout.state_bytes, &view).ok());
  entries[1].master_layout = static_cast<uint32_t>(wire::MasterLayout::kWeightSlot);
  entries[1].master_offset = entries[1].exp_avg_offset;  // a state array it does not have
  st = CheckStateSegment(mem.state, mem.layout.state_bytes, &view);
  CHECK(st.message().find("entry 1: state arrays out of range") != std::string::npos);
  entries[1].master_offset = 0;
  // Entry 0 (bf16): its low halves must lie inside the segment.
  entries[0].master_offset = mem.layout.state_bytes - 64;
  st = CheckStateSegment(mem.state, mem.layout.state_bytes, &view);
  CHECK(st.message().find("entry 0: state arrays out of range") != std::string::npos);
}

TEST_CASE("A fresh state's view is the one its adoption reads back: solo, pooled, group",
          "[recovery]") {
  // Note [One path for sessions and groups]: a fresh registration is bound and
  // described from WriteState's view, an adopted one from CheckStateSegment's;
  // a field on which they differ would bind a resumed state unlike the fresh one.
  for (int kind = 0; kind < 3; ++kind) {
    v1::RegisterParametersRequest req = Request(Case{});
    req.set_threads(2);
    if (kind == 1) req.set_grad_pool_bytes(1 << 16);
    const uint32_t ranks = kind == 2 ? 3 : 0;
    const RegistrationLayout layout = ComputeRegistrationLayout(
        req, ranks == 0 ? 1 : ranks, ranks != 0, RecoveryLayoutOptions{true, kPlaneChunkElems, 2});
    std::vector<char> state(layout.state_bytes);
    auto* header = reinterpret_cast<wire::SegmentHeader*>(state.data());
    header->magic = wire::kSegmentMagic;
    header->version = wire::kSegmentVersion;
    header->total_bytes = layout.state_bytes;
    RecoveryOwner owner;
    owner.staging_name = "trainstream-test";
    owner.staging_bytes = layout.staging_bytes;
    owner.world_size = ranks;
    owner.nnodes = ranks != 0 ? 1 : 0;
    const StateSegmentView fresh = WriteState(state.data(), layout, req, &owner);
    reinterpret_cast<wire::RecoveryHeader*>(state.data() + layout.recovery_offset)
        ->flags.fetch_or(wire::kRecoveryInitialized);  // as the engine's Init does
    StateSegmentView read;
    REQUIRE(CheckStateSegment(state.data(), layout.state_bytes, &read).ok());
    CHECK(fresh.moment_dtype == read.moment_dtype);
    CHECK(fresh.seed == read.seed);
    CHECK(fresh.max_grad_norm == read.max_grad_norm);
    CHECK(fresh.threads == read.threads);
    CHECK(fresh.recovery_offset == read.recovery_offset);
    CHECK(fresh.group_ranks == read.group_ranks);
    CHECK(fresh.grad_pool_offset == read.grad_pool_offset);
    CHECK(fresh.grad_pool_bytes == read.grad_pool_bytes);
    REQUIRE(fresh.params.size() == read.params.size());
    for (size_t i = 0; i < fresh.params.size(); ++i) {
      const CheckedParam& a = fresh.params[i];
      const CheckedParam& b = read.params[i];
      CHECK(a.param_id == b.param_id);
      CHECK(a.name == b.name);
      CHECK(a.numel == b.numel);
      CHECK(a.group == b.group);
      CHECK(a.dtype == b.dtype);
      CHECK(a.grad_dtype == b.grad_dtype);
      CHECK(a.master_layout == b.master_layout);
      CHECK(a.master_offset == b.master_offset);
      CHECK(a.exp_avg_offset == b.exp_avg_offset);
      CHECK(a.exp_avg_sq_offset == b.exp_avg_sq_offset);
      CHECK(a.grad_offset == b.grad_offset);
      CHECK(a.param_offset == b.param_offset);
      CHECK(a.rank_grad_offset == b.rank_grad_offset);
      CHECK(a.rank_grad_stride == b.rank_grad_stride);
      CHECK(a.rank_grad_dtype == b.rank_grad_dtype);
      CHECK(a.chunk_first == b.chunk_first);
      CHECK(a.chunks == b.chunks);
      CHECK(a.step_offset == b.step_offset);
    }
  }
}

TEST_CASE("A pooled state (version 5) is adopted only with its gradients inside its pool",
          "[recovery][grad_pool]") {
  // docs/staging-pool.md, "Recovery": each record names the pool extent its last
  // submission read; the pool lies where this daemon puts it, inside the staging.
  const Case c;
  v1::RegisterParametersRequest req = Request(c);
  req.set_grad_pool_bytes(1 << 16);
  Memory mem(req, 2);
  const uint64_t cap = mem.layout.grad_pool_bytes;  // rounded up to the largest gradient
  REQUIRE(cap == AlignUp(kSizes[0] * 4, 4096));
  RecoveryOwner owner;
  owner.staging_name = "trainstream-test";
  owner.staging_bytes = mem.layout.staging_bytes;
  PlaneRegistration reg =
      BindState(WriteState(mem.state, mem.layout, req, &owner), mem.state, mem.staging);
  REQUIRE(reg.pool != nullptr);
  optimizer::WorkerPool pool(optimizer::WorkerPoolOptions{2, false});
  {
    optimizer::AdamWEngine engine(&pool, Options(c));
    for (size_t p = 0; p < kSizes.size(); ++p) {
      WriteWeights(mem.ParamSlot(p), p);
      optimizer::ParamBinding eb = EngineBinding(reg.params[p]);
      eb.grad_per_submit = true;
      REQUIRE(engine.AddParam(eb).ok());
    }
    REQUIRE(engine.Init().ok());
    // One update at a moving pool position: the record names it.
    optimizer::GradRef ref;
    REQUIRE(reg.pool->Accept(10, cap, kSizes[0] * 4, kSizes[0] * 4, &ref).ok());
    REQUIRE(engine.SubmitGrad(10, 1, kHp, &ref).ok());
    REQUIRE(engine.StepEnd(1).ok());
    engine.WaitIdle();
  }
  StateSegmentView view;
  REQUIRE(CheckStateSegment(mem.state, mem.layout.state_bytes, &view).ok());
  CHECK(view.grad_pool_offset == wire::kGradPoolOffset);
  CHECK(view.grad_pool_bytes == cap);
  CHECK(view.params[0].grad_offset == wire::kGradPoolOffset);  // position C: the next lap
  CHECK(view.params[1].grad_offset == wire::kGradPoolOffset);
  auto* rh = reinterpret_cast<wire::RecoveryHeader*>(mem.state + mem.layout.recovery_offset);
  CHECK(rh->version == wire::kRecoveryVersionPooled);
  auto* records = reinterpret_cast<wire::ParamRecord*>(mem.state + mem.layout.records_offset);
  const uint64_t good = records[0].grad_offset;
  records[0].grad_offset = records[0].rank_grad_offset =
      wire::kGradPoolOffset + 4096;  // runs past the pool's end
  trainstream::Status st = CheckStateSegment(mem.state, mem.layout.state_bytes, &view);
  CHECK(st.message().find("entry 0: gradient outside the pool") != std::string::npos);
  records[0].grad_offset = records[0].rank_grad_offset = good;
  rh->grad_pool_offset = 4096;  // not where this daemon puts a pool
  st = CheckStateSegment(mem.state, mem.layout.state_bytes, &view);
  CHECK(st.message().find("gradient pool out of range") != std::string::npos);
  rh->grad_pool_offset = wire::kGradPoolOffset;
  rh->grad_pool_bytes = mem.layout.staging_bytes;  // past the staging's end
  CHECK(!CheckStateSegment(mem.state, mem.layout.state_bytes, &view).ok());
  rh->grad_pool_bytes = cap;
  REQUIRE(CheckStateSegment(mem.state, mem.layout.state_bytes, &view).ok());
  rh->version = 6;
  st = CheckStateSegment(mem.state, mem.layout.state_bytes, &view);
  CHECK(st.message().find("unknown recovery version 6 (this daemon reads 4 and 5)") !=
        std::string::npos);
  // An undo journal's segment (versions 2 and 3): its slots mean the opposite; refused.
  for (uint32_t old : {wire::kRecoveryVersionUndo, wire::kRecoveryVersionUndoPooled}) {
    rh->version = old;
    st = CheckStateSegment(mem.state, mem.layout.state_bytes, &view);
    CHECK(st.message().find("written by an older daemon, whose undo journal") != std::string::npos);
  }
}
