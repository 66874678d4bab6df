// WorkerPool and AdamWEngine: the engine on several threads must give exactly
// what the scalar kernel gives applied parameter by parameter, in eager and
// deferred modes, and must leave state untouched for non-finite gradients.
#include "trainstream/optimizer/adamw_engine.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "catch_compat.h"
#include "trainstream/kernels/adamw.h"
#include "trainstream/kernels/bf16.h"
#include "trainstream/optimizer/worker_pool.h"
#include "trainstream/platform/threads.h"

using namespace trainstream::optimizer;
using trainstream::StatusCode;
using trainstream::kernels::Bf16ToFloat;
using trainstream::kernels::FloatBits;
using trainstream::kernels::FloatToBf16Rne;
using trainstream::kernels::Isa;

TEST_CASE("worker pool runs each task on its worker, in order", "[pool]") {
  std::vector<std::vector<int>> seen(3);
  std::atomic<int> wrong{0};
  {
    WorkerPool pool(WorkerPoolOptions{3, false});
    REQUIRE(pool.size() == 3);
    for (int i = 0; i < 300; ++i) {
      const unsigned w = static_cast<unsigned>(i % 3);
      pool.Submit(w, [&, w, i] {
        if (WorkerPool::CurrentWorker() != static_cast<int>(w)) ++wrong;
        seen[w].push_back(i);  // only worker w touches seen[w]
      });
    }
  }  // destructor drains the queues
  CHECK(wrong == 0);
  for (unsigned w = 0; w < 3; ++w) {
    REQUIRE(seen[w].size() == 100);
    for (size_t k = 1; k < seen[w].size(); ++k) CHECK(seen[w][k] > seen[w][k - 1]);
  }
  CHECK(WorkerPool::CurrentWorker() == -1);
  CHECK(!PhysicalCoreCpus().empty());
}

TEST_CASE("pinned workers run on one physical core each, named ts-adamw-<i>", "[pool]") {
  const std::vector<int> cores = PhysicalCoreCpus();
  std::vector<int> ran_on(cores.size(), -2);
  std::vector<std::string> names(cores.size());
  {
    WorkerPool pool(WorkerPoolOptions{0, true});
    REQUIRE(pool.size() == cores.size());
    for (unsigned w = 0; w < pool.size(); ++w) {
      pool.Submit(w, [&, w] {
        ran_on[w] = trainstream::platform::CurrentCpu();
        names[w] = trainstream::platform::CurrentThreadName();
      });
    }
  }
  for (size_t w = 0; w < cores.size(); ++w) {
    CHECK(ran_on[w] == cores[w]);
    CHECK(names[w] == "ts-adamw-" + std::to_string(w));
  }
}

namespace {

struct Tensor {
  std::vector<float> master, m, v, grad, slot;
};

struct Fixture {
  std::vector<size_t> sizes{1, 7, 4097, 200003};
  std::vector<Tensor> t;
  explicit Fixture(uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal;
    for (size_t n : sizes) {
      Tensor x;
      x.master.resize(n);
      x.m.resize(n);
      x.v.resize(n);
      x.grad.resize(n);
      x.slot.resize(n);
      for (float& f : x.slot) f = normal(rng);
      t.push_back(std::move(x));
    }
  }
  void NewGrads(uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal;
    for (Tensor& x : t) {
      for (float& f : x.grad) f = normal(rng);
    }
  }
};

AdamWHyperParams Hp(size_t i) {
  AdamWHyperParams hp;
  hp.lr = i % 2 ? 1e-2 : 3e-3;  // two "groups"
  hp.weight_decay = i % 2 ? 0.0 : 0.1;
  return hp;
}

// The reference: the scalar kernel on each whole tensor, one thread.
void ReferenceStep(Fixture& f, uint64_t step, float scale) {
  for (size_t i = 0; i < f.t.size(); ++i) {
    Tensor& x = f.t[i];
    trainstream::kernels::AdamWRange r{x.master.data(), x.m.data(),      x.v.data(),
                                       x.grad.data(),   x.slot.data(),   x.master.size(),
                                       DType::kFloat32, DType::kFloat32, DType::kFloat32};
    trainstream::kernels::AdamWUpdate(
        r, trainstream::kernels::ComputeAdamWStepScalars(Hp(i), step, scale),
        trainstream::kernels::RoundingKey{0, i, step, 0}, Isa::kScalar);
  }
}

// grad_per_submit: no gradient slot; each SubmitGrad names where its gradient lies.
void Bind(AdamWEngine& engine, Fixture& f, bool grad_per_submit = false) {
  for (size_t i = 0; i < f.t.size(); ++i) {
    Tensor& x = f.t[i];
    ParamBinding b;
    b.param_id = i;
    b.numel = x.master.size();
    b.master = x.master.data();
    b.exp_avg = x.m.data();
    b.exp_avg_sq = x.v.data();
    if (grad_per_submit) {
      b.grad_per_submit = true;
    } else {
      b.grad_slot = x.grad.data();
    }
    b.param_slot = x.slot.data();
    REQUIRE(engine.AddParam(b).ok());
  }
  REQUIRE(engine.Init().ok());
}

struct Recorder {
  std::mutex mu;
  std::vector<StepResult> steps;
  int params_done = 0;
  int params_skipped = 0;
  void Attach(AdamWEngine& engine) {
    engine.SetCallbacks(
        [this](uint64_t, uint64_t, bool updated, uint64_t) {
          std::lock_guard<std::mutex> lock(mu);
          ++(updated ? params_done : params_skipped);
        },
        [this](const StepResult& r) {
          std::lock_guard<std::mutex> lock(mu);
          steps.push_back(r);
        });
  }
};

double GlobalNorm(const Fixture& f) {
  double s = 0;
  for (const Tensor& x : f.t) {
    for (float g : x.grad) s += static_cast<double>(g) * g;
  }
  return std::sqrt(s);
}

}  // namespace

TEST_CASE("eager engine on 3 threads equals the scalar kernel", "[engine]") {
  for (bool per_chunk : {false, true}) {
    INFO("eager_check_per_chunk " << per_chunk);
    WorkerPool pool(WorkerPoolOptions{3, false});
    Fixture got(1), want(1);
    EngineOptions opt;
    opt.chunk_elems = 65536;
    opt.eager_check_per_chunk = per_chunk;
    AdamWEngine engine(&pool, opt);
    REQUIRE_FALSE(engine.deferred());
    Recorder rec;
    rec.Attach(engine);
    Bind(engine, got);
    for (size_t i = 0; i < want.t.size(); ++i) {
      want.t[i].master = want.t[i].slot;  // what Init does
      CHECK(got.t[i].master == want.t[i].master);
    }
    for (uint64_t step = 1; step <= 4; ++step) {
      got.NewGrads(static_cast<uint32_t>(step));
      want.NewGrads(static_cast<uint32_t>(step));
      for (size_t i = 0; i < got.t.size(); ++i) REQUIRE(engine.SubmitGrad(i, step, Hp(i)).ok());
      REQUIRE(engine.StepEnd(step).ok());
      engine.WaitIdle();
      ReferenceStep(want, step, 1.0f);
    }
    for (size_t i = 0; i < got.t.size(); ++i) {
      CHECK(got.t[i].master == want.t[i].master);
      CHECK(got.t[i].m == want.t[i].m);
      CHECK(got.t[i].v == want.t[i].v);
      CHECK(got.t[i].slot == want.t[i].slot);
    }
    REQUIRE(rec.steps.size() == 4);
    CHECK(rec.params_done == 16);
    CHECK(rec.steps.back().params_updated == 4);
    CHECK(rec.steps.back().grad_norm == Approx(GlobalNorm(want)).epsilon(1e-12));

    // state export/import round trip
    std::vector<float> ma(4097), ea(4097), eb(4097);
    uint64_t step = 0;
    REQUIRE(engine.ExportState(2, ma.data(), ea.data(), eb.data(), &step).ok());
    CHECK(step == 4);
    CHECK(ma == want.t[2].master);
    CHECK(eb == want.t[2].v);
    ma[0] = 5.0f;
    REQUIRE(engine.ImportState(2, ma.data(), ea.data(), eb.data(), 9).ok());
    CHECK(got.t[2].slot[0] == 5.0f);
    REQUIRE(engine.ExportState(2, ma.data(), ea.data(), eb.data(), &step).ok());
    CHECK(step == 9);
  }
}

TEST_CASE("deferred engine clips by the global norm like clip_grad_norm_", "[engine]") {
  WorkerPool pool(WorkerPoolOptions{2, false});
  Fixture got(2), want(2);
  EngineOptions opt;
  opt.max_grad_norm = 1.0;
  AdamWEngine engine(&pool, opt);
  REQUIRE(engine.deferred());
  Recorder rec;
  rec.Attach(engine);
  Bind(engine, got);
  for (auto& x : want.t) x.master = x.slot;
  for (uint64_t step = 1; step <= 3; ++step) {
    got.NewGrads(static_cast<uint32_t>(step + 10));
    want.NewGrads(static_cast<uint32_t>(step + 10));
    for (size_t i = 0; i < got.t.size(); ++i) REQUIRE(engine.SubmitGrad(i, step, Hp(i)).ok());
    REQUIRE(engine.StepEnd(step).ok());
    engine.WaitIdle();
    const float norm = static_cast<float>(GlobalNorm(want));
    const float coef = (1.0f / (norm + 1e-6f)) * 1.0f;
    ReferenceStep(want, step, coef < 1.0f ? coef : 1.0f);
  }
  for (size_t i = 0; i < got.t.size(); ++i) {
    for (size_t k = 0; k < got.t[i].master.size(); ++k) {
      REQUIRE(got.t[i].master[k] == Approx(want.t[i].master[k]).epsilon(1e-6).margin(1e-7));
    }
  }
  REQUIRE(rec.steps.size() == 3);
  CHECK(rec.steps[0].grad_norm > 1.0);
}

TEST_CASE("non-finite gradient: eager skips that parameter, deferred skips the step", "[engine]") {
  for (bool deferred : {false, true}) {
    INFO("deferred " << deferred);
    WorkerPool pool(WorkerPoolOptions{2, false});
    Fixture f(3);
    EngineOptions opt;
    opt.skip_nonfinite_step = deferred;
    AdamWEngine engine(&pool, opt);
    Recorder rec;
    rec.Attach(engine);
    Bind(engine, f);
    f.NewGrads(5);
    f.t[3].grad[150000] = NAN;
    const Fixture before = f;
    for (size_t i = 0; i < f.t.size(); ++i) REQUIRE(engine.SubmitGrad(i, 1, Hp(i)).ok());
    REQUIRE(engine.StepEnd(1).ok());
    engine.WaitIdle();
    REQUIRE(rec.steps.size() == 1);
    const StepResult& r = rec.steps[0];
    CHECK(r.skipped_nonfinite);
    CHECK(r.nonfinite_params == std::vector<uint64_t>{3});
    CHECK_FALSE(r.error.ok());
    CHECK(f.t[3].master == before.t[3].master);
    CHECK(f.t[3].m == before.t[3].m);
    CHECK(f.t[3].v == before.t[3].v);
    CHECK(f.t[3].slot == before.t[3].slot);
    CHECK(r.params_updated == (deferred ? 0u : 3u));
    CHECK((f.t[0].master == before.t[0].master) == deferred);
    std::vector<float> a(200003), b(200003), c(200003);
    uint64_t step = 99;
    REQUIRE(engine.ExportState(3, a.data(), b.data(), c.data(), &step).ok());
    CHECK(step == 0);  // the skipped parameter's step count did not advance
    REQUIRE(engine.ExportState(0, a.data(), b.data(), c.data(), &step).ok());
    CHECK(step == (deferred ? 0u : 1u));
  }
}

TEST_CASE("eager per-chunk check leaves exactly the non-finite chunk untouched", "[engine]") {
  WorkerPool pool(WorkerPoolOptions{2, false});
  Fixture f(3), want(3);
  EngineOptions opt;
  opt.chunk_elems = 65536;
  opt.eager_check_per_chunk = true;
  AdamWEngine engine(&pool, opt);
  Recorder rec;
  rec.Attach(engine);
  Bind(engine, f);
  for (Tensor& x : want.t) x.master = x.slot;  // what Init does
  f.NewGrads(5);
  want.NewGrads(5);
  f.t[3].grad[150000] = NAN;  // chunk 2 of parameter 3: elements [131072, 196608)
  const Fixture before = f;
  for (size_t i = 0; i < f.t.size(); ++i) REQUIRE(engine.SubmitGrad(i, 1, Hp(i)).ok());
  REQUIRE(engine.StepEnd(1).ok());
  engine.WaitIdle();
  ReferenceStep(want, 1, 1.0f);
  REQUIRE(rec.steps.size() == 1);
  const StepResult& r = rec.steps[0];
  CHECK(r.skipped_nonfinite);
  CHECK(r.nonfinite_params == std::vector<uint64_t>{3});
  CHECK(r.error.message().find("non-finite") != std::string::npos);
  CHECK(r.params_updated == 4u);
  for (size_t i = 0; i < 3; ++i) CHECK(f.t[i].master == want.t[i].master);
  for (size_t e = 0; e < f.t[3].master.size(); ++e) {
    const bool bad_chunk = e >= 131072 && e < 196608;
    const Tensor& ref = bad_chunk ? before.t[3] : want.t[3];
    if (f.t[3].master[e] != ref.master[e] || f.t[3].m[e] != ref.m[e] || f.t[3].v[e] != ref.v[e] ||
        f.t[3].slot[e] != ref.slot[e]) {
      FAIL("element " << e << " (bad chunk " << bad_chunk << ") differs");
    }
  }
  std::vector<float> a(200003), b(200003), c(200003);
  uint64_t step = 0;
  REQUIRE(engine.ExportState(3, a.data(), b.data(), c.data(), &step).ok());
  CHECK(step == 1);  // other chunks were applied
}

TEST_CASE("an engine limited to some workers runs only on them and still equals the kernel",
          "[engine]") {
  WorkerPool pool(WorkerPoolOptions{4, false});
  Fixture got(5), want(5);
  EngineOptions opt;
  opt.chunk_elems = 4096;  // many chunks, so an unlimited engine would use every worker
  opt.workers = 2;
  opt.first_worker = 3;  // workers 3 and 0 (wrapping)
  AdamWEngine engine(&pool, opt);
  std::mutex mu;
  std::set<int> seen;
  engine.SetCallbacks(
      [&](uint64_t, uint64_t, bool, uint64_t) {
        std::lock_guard<std::mutex> lock(mu);
        seen.insert(WorkerPool::CurrentWorker());
      },
      nullptr);
  Bind(engine, got);
  for (auto& x : want.t) x.master = x.slot;
  for (uint64_t step = 1; step <= 3; ++step) {
    got.NewGrads(static_cast<uint32_t>(step));
    want.NewGrads(static_cast<uint32_t>(step));
    for (size_t i = 0; i < got.t.size(); ++i) REQUIRE(engine.SubmitGrad(i, step, Hp(i)).ok());
    REQUIRE(engine.StepEnd(step).ok());
    engine.WaitIdle();
    ReferenceStep(want, step, 1.0f);
  }
  for (size_t i = 0; i < got.t.size(); ++i) CHECK(got.t[i].master == want.t[i].master);
  CHECK_FALSE(seen.empty());
  for (int w : seen) CHECK((w == 3 || w == 0));

  // One field at a time: the others are untouched.
  using Array = AdamWEngine::StateArray;
  const size_t n = want.t[2].master.size();
  std::vector<float> v(n), m(n);
  REQUIRE(engine.ExportArray(2, Array::kExpAvgSq, v.data()).ok());
  CHECK(v == want.t[2].v);
  REQUIRE(engine.ExportArray(2, Array::kExpAvg, m.data()).ok());
  std::vector<float> ones(n, 1.0f);
  REQUIRE(engine.ImportArray(2, Array::kExpAvg, ones.data()).ok());
  REQUIRE(engine.ExportArray(2, Array::kExpAvgSq, v.data()).ok());
  CHECK(v == want.t[2].v);
  REQUIRE(engine.ImportArray(2, Array::kMaster, ones.data()).ok());
  CHECK(got.t[2].slot == ones);  // the param slot follows the master
  uint64_t step = 0;
  REQUIRE(engine.GetStep(2, &step).ok());
  CHECK(step == 3);
  REQUIRE(engine.SetStep(2, 11).ok());
  REQUIRE(engine.GetStep(2, &step).ok());
  CHECK(step == 11);
  CHECK_FALSE(engine.ExportArray(99, Array::kMaster, v.data()).ok());
}

// Regression: a client that died between its gradients and STEP_END left a
// deferred step in flight, and the engine's destructor (the daemon's session
// teardown) waited for it forever.
TEST_CASE("destroying a deferred engine with a step never ended returns", "[engine]") {
  WorkerPool pool(WorkerPoolOptions{2, false});
  Fixture f(3);
  EngineOptions opt;
  opt.max_grad_norm = 1.0;
  auto engine = std::make_unique<AdamWEngine>(&pool, opt);
  Bind(*engine, f);
  f.NewGrads(5);
  for (size_t i = 0; i < f.t.size(); ++i) REQUIRE(engine->SubmitGrad(i, 1, Hp(i)).ok());
  engine.reset();  // no StepEnd(1): must not hang
  SUCCEED("destroyed");
}

TEST_CASE("a split-master engine trains like an fp32-master engine with a bf16 copy", "[engine]") {
  const std::vector<size_t> sizes{1, 7, 4097, 200003};
  WorkerPool pool(WorkerPoolOptions{3, false});
  EngineOptions opt;
  opt.chunk_elems = 1024;
  AdamWEngine full(&pool, opt), split(&pool, opt);
  struct Bufs {
    std::vector<float> master, m, v, m2, v2;
    std::vector<uint16_t> grad, slot, slot2, lo;
  };
  std::vector<Bufs> bufs(sizes.size());
  std::mt19937 rng(5);
  std::normal_distribution<float> normal;
  for (size_t k = 0; k < sizes.size(); ++k) {
    const size_t n = sizes[k];
    Bufs& b = bufs[k];
    b.master.resize(n);
    b.m.resize(n);
    b.v.resize(n);
    b.m2.resize(n);
    b.v2.resize(n);
    b.grad.resize(n);
    b.lo.resize(n);
    b.slot.resize(n);
    for (uint16_t& h : b.slot) h = FloatToBf16Rne(normal(rng));
    b.slot2 = b.slot;
    ParamBinding a{k,          n,          DType::kBFloat16, DType::kBFloat16, b.master.data(),
                   b.m.data(), b.v.data(), b.grad.data(),    b.slot.data()};
    ParamBinding s{k,           n,           DType::kBFloat16, DType::kBFloat16, nullptr,
                   b.m2.data(), b.v2.data(), b.grad.data(),    b.slot2.data()};
    s.master_lo = b.lo.data();
    REQUIRE(full.AddParam(a).ok());
    REQUIRE(split.AddParam(s).ok());
  }
  ParamBinding bad{99,
                   4,
                   DType::kFloat32,
                   DType::kFloat32,
                   nullptr,
                   bufs[0].m.data(),
                   bufs[0].v.data(),
                   bufs[0].grad.data(),
                   bufs[0].slot.data()};
  bad.master_lo = bufs[0].lo.data();
  CHECK(split.AddParam(bad).message().find("bf16 param_slot") != std::string::npos);
  REQUIRE(full.Init().ok());
  REQUIRE(split.Init().ok());
  for (uint64_t step = 1; step <= 5; ++step) {
    for (size_t k = 0; k < sizes.size(); ++k) {
      for (uint16_t& g : bufs[k].grad) g = FloatToBf16Rne(normal(rng));
    }
    for (AdamWEngine* e : {&full, &split}) {
      for (size_t k = 0; k < sizes.size(); ++k) REQUIRE(e->SubmitGrad(k, step, Hp(k)).ok());
      REQUIRE(e->StepEnd(step).ok());
      e->WaitIdle();
    }
  }
  size_t ulp_off = 0, total = 0;
  for (size_t k = 0; k < sizes.size(); ++k) {
    const size_t n = sizes[k];
    const Bufs& b = bufs[k];
    CHECK(b.slot2 == b.slot);  // the bf16 weights the GPU gets: identical
    CHECK(b.m2 == b.m);
    CHECK(b.v2 == b.v);
    std::vector<float> exported(n);
    REQUIRE(split.ExportArray(k, AdamWEngine::StateArray::kMaster, exported.data()).ok());
    for (size_t i = 0; i < n; ++i) {
      // A tie-up moves a master one ulp; later steps can carry that to a few ulps.
      ulp_off += FloatBits(exported[i]) != FloatBits(b.master[i]);
      REQUIRE(std::abs(static_cast<int64_t>(FloatBits(exported[i])) -
                       static_cast<int64_t>(FloatBits(b.master[i]))) <= 5);
    }
    total += n;
    // Importing an fp32 master writes both halves; exporting gives it back.
    REQUIRE(split.ImportArray(k, AdamWEngine::StateArray::kMaster, b.master.data()).ok());
    REQUIRE(split.ExportArray(k, AdamWEngine::StateArray::kMaster, exported.data()).ok());
    for (size_t i = 0; i < n; ++i) {
      CHECK(bufs[k].slot2[i] == FloatToBf16Rne(b.master[i]));
      CHECK(std::abs(static_cast<int64_t>(FloatBits(exported[i])) -
                     static_cast<int64_t>(FloatBits(b.master[i]))) <= 1);
    }
  }
  // Tie-ups (one ulp further out) happen about once in 2^17 elements per step.
  CHECK(ulp_off * 1000 < total);
}

TEST_CASE("gradients named per submission at moving addresses equal a bound slot", "[engine]") {
  for (double clip : {0.0, 0.5}) {
    INFO("max_grad_norm " << clip);
    WorkerPool pool(WorkerPoolOptions{2, false});
    EngineOptions opt;
    opt.chunk_elems = 65536;
    opt.max_grad_norm = clip;
    AdamWEngine slots(&pool, opt), named(&pool, opt);
    Fixture a(3), b(3);
    Bind(slots, a);
    Bind(named, b, /*grad_per_submit=*/true);  // each step's gradient lies elsewhere
    CHECK(named.SubmitGrad(0, 1, Hp(0)).code() == trainstream::StatusCode::kInvalidArgument);
    std::vector<std::vector<float>> laps(3);
    for (uint64_t step = 1; step <= 3; ++step) {
      a.NewGrads(static_cast<uint32_t>(step));
      std::vector<float>& lap = laps[step - 1];
      size_t total = 0;
      for (const Tensor& x : a.t) total += x.grad.size() + 16;
      lap.assign(total, 0.0f);
      size_t at = 5 * step;  // moves every step
      for (size_t i = 0; i < a.t.size(); ++i) {
        std::copy(a.t[i].grad.begin(), a.t[i].grad.end(), lap.begin() + at);
        GradRef ref{lap.data() + at, at * 4};
        REQUIRE(slots.SubmitGrad(i, step, Hp(i)).ok());
        REQUIRE(named.SubmitGrad(i, step, Hp(i), &ref).ok());
        at += a.t[i].grad.size() + 3;
      }
      REQUIRE(slots.StepEnd(step).ok());
      REQUIRE(named.StepEnd(step).ok());
      slots.WaitIdle();
      named.WaitIdle();
    }
    for (size_t i = 0; i < a.t.size(); ++i) {
      CHECK(std::memcmp(a.t[i].master.data(), b.t[i].master.data(), a.t[i].master.size() * 4) == 0);
      CHECK(std::memcmp(a.t[i].m.data(), b.t[i].m.data(), a.t[i].m.size() * 4) == 0);
      CHECK(std::memcmp(a.t[i].v.data(), b.t[i].v.data(), a.t[i].v.size() * 4) == 0);
    }
  }
}

// Note [Weights written from outside the engine]: weights handed over become the
// master's value where they differ from the slot and leave the rest alone; a slot
// written in place is taken whole by a split master (its old high half is gone) and
// element by element by a separate one.
TEST_CASE("weights written from outside the engine become the masters", "[engine]") {
  using Array = AdamWEngine::StateArray;
  const size_t n = 5003;
  WorkerPool pool(WorkerPoolOptions{2, false});
  EngineOptions opt;
  opt.chunk_elems = 1024;
  AdamWEngine engine(&pool, opt);
  std::mt19937 rng(11);
  std::normal_distribution<float> normal;
  // 0: bf16, split master; 1: bf16, separate fp32 master; 2: fp32, the slot is the master.
  std::vector<uint16_t> slot0(n), slot1(n), lo(n), grad16(n);
  std::vector<float> master1(n), slot2(n), grad32(n);
  std::vector<std::vector<float>> m(3, std::vector<float>(n)), v(3, std::vector<float>(n));
  for (size_t i = 0; i < n; ++i) {
    slot0[i] = slot1[i] = FloatToBf16Rne(normal(rng));
    slot2[i] = normal(rng);
  }
  ParamBinding b0{0,           n,           DType::kBFloat16, DType::kBFloat16, nullptr,
                  m[0].data(), v[0].data(), grad16.data(),    slot0.data()};
  b0.master_lo = lo.data();
  ParamBinding b1{1,           n,           DType::kBFloat16, DType::kBFloat16, master1.data(),
                  m[1].data(), v[1].data(), grad16.data(),    slot1.data()};
  ParamBinding b2{2,           n,           DType::kFloat32, DType::kFloat32, slot2.data(),
                  m[2].data(), v[2].data(), grad32.data(),   slot2.data()};
  for (const ParamBinding& b : {b0, b1, b2}) REQUIRE(engine.AddParam(b).ok());
  REQUIRE(engine.Init().ok());
  auto train = [&](uint64_t first, uint64_t last) {
    for (uint64_t step = first; step <= last; ++step) {
      for (size_t i = 0; i < n; ++i) {
        grad16[i] = FloatToBf16Rne(normal(rng));
        grad32[i] = normal(rng);
      }
      for (uint64_t id = 0; id < 3; ++id) REQUIRE(engine.SubmitGrad(id, step, Hp(0)).ok());
      REQUIRE(engine.StepEnd(step).ok());
      engine.WaitIdle();
    }
  };
  auto masters = [&](uint64_t id) {
    std::vector<float> out(n);
    REQUIRE(engine.ExportArray(id, Array::kMaster, out.data()).ok());
    return out;
  };
  train(1, 3);
  std::vector<std::vector<float>> before{masters(0), masters(1), masters(2)};
  std::vector<float> m_before = m[0];
  // Every third element zeroed, every third halved (exact in bf16), the rest as they are.
  std::vector<uint16_t> w16 = slot0;
  std::vector<float> w32 = slot2;
  for (size_t i = 0; i < n; ++i) {
    if (i % 3 == 0) {
      w16[i] = 0;
      w32[i] = 0;
    } else if (i % 3 == 1) {
      w16[i] = FloatToBf16Rne(0.5f * Bf16ToFloat(w16[i]));
      w32[i] *= 0.5f;
    }
  }
  REQUIRE(engine.AdoptWeights(0, w16.data(), n * 2).ok());
  REQUIRE(engine.AdoptWeights(1, w16.data(), n * 2).ok());
  REQUIRE(engine.AdoptWeights(2, w32.data(), n * 4).ok());
  CHECK(engine.AdoptWeights(0, w16.data(), n * 4).code() == StatusCode::kInvalidArgument);
  CHECK(engine.AdoptWeights(7, w16.data(), n * 2).code() == StatusCode::kNotFound);
  CHECK(slot0 == w16);
  CHECK(slot1 == w16);
  CHECK(m[0] == m_before);  // moments (and step) are kept
  for (uint64_t id = 0; id < 3; ++id) {
    const std::vector<float> got = masters(id);
    for (size_t i = 0; i < n; ++i) {
      const float want = id == 2 ? w32[i] : i % 3 == 2 ? before[id][i] : Bf16ToFloat(w16[i]);
      INFO("param " << id << " element " << i);
      REQUIRE(FloatBits(got[i]) == FloatBits(want));
    }
  }
  uint64_t step = 0;
  REQUIRE(engine.GetStep(0, &step).ok());
  CHECK(step == 3);
  // The split and the separate master took the same weights: they train on alike.
  train(4, 5);
  CHECK(slot0 == slot1);

  // A slot written in place (a paged weight's home): zeros, whose old low halves would
  // decode to NaN. The split master takes the whole slot; the separate one the
  // elements that changed.
  before = {masters(0), masters(1), masters(2)};
  for (size_t i = 0; i < n; i += 2) {
    slot0[i] = slot1[i] = 0;
    slot2[i] = 0;
  }
  for (uint64_t id = 0; id < 3; ++id) REQUIRE(engine.AdoptWeights(id, nullptr, 0).ok());
  CHECK(engine.AdoptWeights(0, nullptr, 2).code() == StatusCode::kInvalidArgument);
  const std::vector<float> got0 = masters(0), got1 = masters(1), got2 = masters(2);
  for (size_t i = 0; i < n; ++i) {
    INFO("element " << i);
    REQUIRE(FloatBits(got0[i]) == FloatBits(Bf16ToFloat(slot0[i])));
    REQUIRE(FloatBits(got1[i]) == FloatBits(i % 2 ? before[1][i] : 0.0f));
    REQUIRE(FloatBits(got2[i]) == FloatBits(slot2[i]));
  }
}
