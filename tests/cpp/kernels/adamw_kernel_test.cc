// Every SIMD AdamW path must reproduce the scalar reference bit for bit
// (Note [AdamW operation order] in kernels/cpu/adamw_impl.h). Paths this CPU
// lacks are skipped with a message naming the missing instructions.
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "catch_compat.h"
#include "trainstream/kernels/adamw.h"
#include "trainstream/kernels/bf16.h"

using namespace trainstream::kernels;

#ifdef SKIP
#define TS_SKIP(msg) SKIP(msg)
#else
#define TS_SKIP(msg) \
  do {               \
    WARN(msg);       \
    return;          \
  } while (0)
#endif

namespace {

struct Buffers {
  std::vector<float> master;
  std::vector<uint8_t> m, v, g, out;
};

Buffers MakeBuffers(size_t n, DType gd, DType md, DType pd, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  Buffers b;
  b.master.resize(n);
  b.m.resize(n * DTypeSize(md));
  b.v.resize(n * DTypeSize(md));
  b.g.resize(n * DTypeSize(gd));
  b.out.assign(n * DTypeSize(pd), 0);
  for (size_t i = 0; i < n; ++i) {
    b.master[i] = normal(rng);
    const float m = 0.1f * normal(rng), v = 0.01f * std::fabs(normal(rng)), g = normal(rng);
    if (md == DType::kFloat32) {
      reinterpret_cast<float*>(b.m.data())[i] = m;
      reinterpret_cast<float*>(b.v.data())[i] = v;
    } else {
      reinterpret_cast<uint16_t*>(b.m.data())[i] = FloatToBf16Rne(m);
      reinterpret_cast<uint16_t*>(b.v.data())[i] = FloatToBf16Rne(v);
    }
    if (gd == DType::kFloat32)
      reinterpret_cast<float*>(b.g.data())[i] = g;
    else if (gd == DType::kBFloat16)
      reinterpret_cast<uint16_t*>(b.g.data())[i] = FloatToBf16Rne(g);
    else
      reinterpret_cast<uint16_t*>(b.g.data())[i] = FloatToFp16Rne(g);
  }
  return b;
}

void RunSteps(Buffers& b, size_t n, DType gd, DType md, DType pd, const AdamWHyperParams& hp,
              Isa isa, size_t offset_elems) {
  for (uint64_t step = 1; step <= 3; ++step) {
    AdamWRange r;
    r.master = b.master.data() + offset_elems;
    r.exp_avg = b.m.data() + offset_elems * DTypeSize(md);
    r.exp_avg_sq = b.v.data() + offset_elems * DTypeSize(md);
    r.grad = b.g.data() + offset_elems * DTypeSize(gd);
    r.param_out = b.out.data() + offset_elems * DTypeSize(pd);
    r.numel = n - offset_elems;
    r.grad_dtype = gd;
    r.moment_dtype = md;
    r.param_dtype = pd;
    AdamWUpdate(r, ComputeAdamWStepScalars(hp, step, step == 2 ? 0.5f : 1.0f),
                RoundingKey{42, 7, step, offset_elems}, isa);
  }
}

void CheckPathMatchesScalar(Isa isa) {
  const DType dtypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};
  const DType moments[] = {DType::kFloat32, DType::kBFloat16};
  AdamWHyperParams hp_default;
  AdamWHyperParams hp_big_weight;  // 1 - beta1 >= 0.5: torch's lerp from the end
  hp_big_weight.beta1 = 0.3;
  hp_big_weight.weight_decay = 0;
  for (DType gd : dtypes) {
    for (DType md : moments) {
      for (DType pd : dtypes) {
        for (size_t n : {1, 7, 8, 17, 64, 4097}) {
          for (const AdamWHyperParams& hp : {hp_default, hp_big_weight}) {
            for (size_t offset : {size_t{0}, n > 3 ? size_t{3} : size_t{0}}) {
              INFO("grad " << DTypeName(gd) << " moments " << DTypeName(md) << " param "
                           << DTypeName(pd) << " n " << n << " offset " << offset << " beta1 "
                           << hp.beta1);
              Buffers ref = MakeBuffers(n, gd, md, pd, static_cast<uint32_t>(n));
              Buffers got = ref;
              RunSteps(ref, n, gd, md, pd, hp, Isa::kScalar, offset);
              RunSteps(got, n, gd, md, pd, hp, isa, offset);
              CHECK(std::memcmp(ref.master.data(), got.master.data(), n * 4) == 0);
              CHECK(ref.m == got.m);
              CHECK(ref.v == got.v);
              CHECK(ref.out == got.out);
            }
          }
        }
      }
    }
  }
}

}  // namespace

TEST_CASE("AVX2 AdamW path matches the scalar path bit for bit", "[adamw]") {
  if (!IsaSupported(Isa::kAvx2)) TS_SKIP("CPU lacks AVX2+FMA: AVX2 path not tested");
  CheckPathMatchesScalar(Isa::kAvx2);
}

TEST_CASE("AVX-512 AdamW path matches the scalar path bit for bit", "[adamw]") {
  if (!IsaSupported(Isa::kAvx512)) {
    TS_SKIP("CPU lacks AVX-512 F/BW/VL/DQ: AVX-512 path not tested (run on an AVX-512 host)");
  }
  INFO("AVX512_BF16 present: " << CpuHasAvx512Bf16());
  CheckPathMatchesScalar(Isa::kAvx512);
}

TEST_CASE("fp32 param_out may alias master", "[adamw]") {
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
    if (!IsaSupported(isa)) continue;
    Buffers b = MakeBuffers(100, DType::kFloat32, DType::kFloat32, DType::kFloat32, 1);
    Buffers ref = b;
    AdamWRange r{b.master.data(), b.m.data(),      b.v.data(),     b.g.data(), b.master.data(), 100,
                 DType::kFloat32, DType::kFloat32, DType::kFloat32};
    AdamWRange rr{ref.master.data(), ref.m.data(),    ref.v.data(),
                  ref.g.data(),      ref.out.data(),  100,
                  DType::kFloat32,   DType::kFloat32, DType::kFloat32};
    const auto s = ComputeAdamWStepScalars(AdamWHyperParams{}, 1, 1.0f);
    AdamWUpdate(r, s, RoundingKey{}, isa);
    AdamWUpdate(rr, s, RoundingKey{}, Isa::kScalar);
    CHECK(b.master == ref.master);
    CHECK(std::memcmp(ref.out.data(), ref.master.data(), 400) == 0);
  }
}

TEST_CASE("bf16 and fp16 conversions round to nearest even", "[adamw]") {
  CHECK(FloatToBf16Rne(1.0f) == 0x3F80);
  CHECK(FloatToBf16Rne(BitsToFloat(0x3F808000u)) == 0x3F80);  // tie, even stays
  CHECK(FloatToBf16Rne(BitsToFloat(0x3F818000u)) == 0x3F82);  // tie, odd rounds up
  CHECK(FloatToBf16Rne(BitsToFloat(0x3F808001u)) == 0x3F81);
  CHECK(FloatToBf16Rne(std::nanf("")) == 0x7FC0);
  // Every finite half survives a round trip through float.
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = Fp16ToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    REQUIRE(FloatToFp16Rne(f) == h);
  }
  CHECK(FloatToFp16Rne(65520.0f) == 0x7C00);            // rounds to infinity
  CHECK(FloatToFp16Rne(1.0f + 1.0f / 2048) == 0x3C00);  // tie to even
}

TEST_CASE("gradient sum of squares agrees across paths and flags non-finite", "[adamw]") {
  std::vector<float> g(1003);
  for (size_t i = 0; i < g.size(); ++i) g[i] = std::sin(static_cast<float>(i));
  const double ref = GradSumSquares(g.data(), DType::kFloat32, g.size(), Isa::kScalar);
  for (Isa isa : {Isa::kAvx2, Isa::kAvx512}) {
    if (!IsaSupported(isa)) continue;
    CHECK(GradSumSquares(g.data(), DType::kFloat32, g.size(), isa) == Approx(ref).epsilon(1e-12));
    g[500] = INFINITY;
    CHECK_FALSE(std::isfinite(GradSumSquares(g.data(), DType::kFloat32, g.size(), isa)));
    g[500] = NAN;
    CHECK_FALSE(std::isfinite(GradSumSquares(g.data(), DType::kFloat32, g.size(), isa)));
    g[500] = 3e38f;  // finite but its square overflows float: must stay finite
    CHECK(std::isfinite(GradSumSquares(g.data(), DType::kFloat32, g.size(), isa)));
    g[500] = std::sin(500.0f);
  }
}

TEST_CASE("stochastic rounding is reproducible and keyed", "[adamw]") {
  std::vector<float> x(1000, 1.0f + 1.0f / 300);
  std::vector<uint16_t> a(1000), b(1000), c(1000);
  StochasticRoundToBf16(x.data(), a.data(), x.size(), RoundingKey{1, 2, 3, 0}, false);
  StochasticRoundToBf16(x.data(), b.data(), x.size(), RoundingKey{1, 2, 3, 0}, false);
  StochasticRoundToBf16(x.data(), c.data(), x.size(), RoundingKey{9, 2, 3, 0}, false);
  CHECK(a == b);
  CHECK(a != c);
  for (uint16_t h : a) CHECK((h == 0x3F80 || h == 0x3F81));
}
