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

TEST_CASE("a split master decodes to the fp32 it encodes, bar tie-ups one ulp out", "[adamw]") {
  // A sweep over fp32 bit patterns (stride prime to 2^16, so every low half is hit),
  // plus every tie below each of a range of upper halves.
  auto check = [](uint32_t u) {
    const float x = BitsToFloat(u);
    uint16_t hi = 0, lo = 0;
    SplitMasterEncode(x, &hi, &lo);
    REQUIRE(hi == FloatToBf16Rne(x));  // the half the GPU trains with: tensor.to(bf16)
    const float y = SplitMasterDecode(hi, lo);
    if (std::isnan(x)) {
      REQUIRE(std::isnan(y));
      return;
    }
    const bool tie_up = (u & 0xFFFFu) == 0x8000u && (u >> 16) != hi;
    REQUIRE(FloatBits(y) == (tie_up ? u + 1 : u));
    REQUIRE(FloatToBf16Rne(y) == hi);  // the moved value still rounds to the same half
  };
  for (uint64_t u = 0; u < (uint64_t{1} << 32); u += 65521) check(static_cast<uint32_t>(u));
  for (uint32_t upper = 0x3F00; upper < 0x3F40; ++upper) check((upper << 16) | 0x8000u);
  for (uint32_t u : {0x7F7FFFFFu, 0xFF7FFFFFu, 0x7F800000u, 0x00000001u, 0x80008000u}) check(u);
}

TEST_CASE("split-master updates agree across paths on any master", "[adamw]") {
  // Arbitrary fp32 masters (ties, subnormals, huge values), encoded; every path must
  // give the scalar path's halves, tails included.
  const size_t n = 4099;
  std::mt19937 rng(3);
  std::uniform_int_distribution<uint32_t> bits;
  std::vector<uint16_t> hi0(n), lo0(n), g(n);
  std::normal_distribution<float> normal;
  for (size_t i = 0; i < n; ++i) {
    uint32_t u = 0x3C000000u + bits(rng) % 0x06000000u;        // about 2^-7 .. 2^5
    if (i % 7 == 0) u = (u & 0xFFFF0000u) | 0x8000u;           // ties
    if (i % 11 == 0) u = bits(rng) % 0x00800000u;              // subnormals
    if (i % 13 == 0) u = 0x7F7F0000u | (bits(rng) & 0xFFFFu);  // near the largest float
    if (i % 2) u |= 0x80000000u;
    SplitMasterEncode(BitsToFloat(u), &hi0[i], &lo0[i]);
    g[i] = FloatToBf16Rne(normal(rng));
  }
  std::vector<std::vector<uint16_t>> his, los;
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
    if (!IsaSupported(isa)) {
      WARN(IsaName(isa) << " path not run: this CPU lacks it (run on an AVX-512 host)");
      continue;
    }
    std::vector<uint16_t> hi = hi0, lo = lo0, m(n, 0), v(n, 0);
    for (uint64_t step = 1; step <= 3; ++step) {
      AdamWRange r;
      r.exp_avg = m.data();
      r.exp_avg_sq = v.data();
      r.grad = g.data();
      r.param_out = hi.data();
      r.master_lo = lo.data();
      r.numel = n;
      r.grad_dtype = DType::kBFloat16;
      r.moment_dtype = DType::kBFloat16;
      r.param_dtype = DType::kBFloat16;
      AdamWUpdate(r, ComputeAdamWStepScalars(AdamWHyperParams{}, step, 1.0f),
                  RoundingKey{1, 2, step, 0}, isa);
    }
    his.push_back(hi);
    los.push_back(lo);
  }
  for (size_t k = 1; k < his.size(); ++k) {
    CHECK(his[k] == his[0]);
    CHECK(los[k] == los[0]);
  }
  CHECK(his[0] != hi0);  // the steps did move the weights
}

TEST_CASE("split-master updates agree across paths and with an fp32 master", "[adamw]") {
  const DType grads[] = {DType::kFloat32, DType::kBFloat16};
  const DType moments[] = {DType::kFloat32, DType::kBFloat16};
  for (DType gd : grads) {
    for (DType md : moments) {
      for (size_t n : {1, 7, 17, 64, 4097}) {
        INFO("grad " << DTypeName(gd) << " moments " << DTypeName(md) << " n " << n);
        // Reference: an fp32 master with a bf16 copy; the split master starts from the
        // same values (masters rounded to bf16, so the split form holds them exactly).
        Buffers ref = MakeBuffers(n, gd, md, DType::kBFloat16, static_cast<uint32_t>(n));
        for (float& x : ref.master) x = Bf16ToFloat(FloatToBf16Rne(x));
        auto* ref_out = reinterpret_cast<uint16_t*>(ref.out.data());
        for (size_t i = 0; i < n; ++i) ref_out[i] = FloatToBf16Rne(ref.master[i]);
        const Buffers start = ref;
        RunSteps(ref, n, gd, md, DType::kBFloat16, AdamWHyperParams{}, Isa::kScalar, 0);
        std::vector<std::vector<uint16_t>> los;
        std::vector<Buffers> outs;
        for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
          if (!IsaSupported(isa)) {
            WARN(IsaName(isa) << " path not run: this CPU lacks it (run on an AVX-512 host)");
            continue;
          }
          Buffers b = start;
          std::vector<uint16_t> lo(n, 0);
          for (uint64_t step = 1; step <= 3; ++step) {
            AdamWRange r;
            r.exp_avg = b.m.data();
            r.exp_avg_sq = b.v.data();
            r.grad = b.g.data();
            r.param_out = b.out.data();
            r.master_lo = lo.data();
            r.numel = n;
            r.grad_dtype = gd;
            r.moment_dtype = md;
            r.param_dtype = DType::kBFloat16;
            AdamWUpdate(r,
                        ComputeAdamWStepScalars(AdamWHyperParams{}, step, step == 2 ? 0.5f : 1.0f),
                        RoundingKey{42, 7, step, 0}, isa);
          }
          los.push_back(lo);
          outs.push_back(b);
        }
        for (size_t k = 1; k < outs.size(); ++k) {  // every path: the scalar path's bits
          CHECK(outs[k].out == outs[0].out);
          CHECK(los[k] == los[0]);
          CHECK(outs[k].m == outs[0].m);
          CHECK(outs[k].v == outs[0].v);
        }
        // Against the fp32 master: the same moments and bf16 weights, and masters equal
        // to the bit (a tie-up, about 1 in 2^17, would differ by one ulp).
        const auto* hi = reinterpret_cast<const uint16_t*>(outs[0].out.data());
        size_t differ = 0;
        for (size_t i = 0; i < n; ++i) {
          const float x = SplitMasterDecode(hi[i], los[0][i]);
          differ += FloatBits(x) != FloatBits(ref.master[i]);
          REQUIRE(std::fabs(x - ref.master[i]) <= std::fabs(ref.master[i]) * 0x1.0p-23f);
        }
        CHECK(differ <= 1);
        CHECK(outs[0].out == ref.out);
        CHECK(outs[0].m == ref.m);
        CHECK(outs[0].v == ref.v);
      }
    }
  }
}

TEST_CASE("an update that reads elsewhere (from) writes what the in-place update does", "[adamw]") {
  // The redo journal's use (trainstream/optimizer/journaled_update.h): old master and
  // moments read from the state, new ones written to other arrays. Every master layout:
  // fp32 with a bf16 weight, fp32 weight that is its own master, split bf16.
  enum class Layout { kFp32, kOwnMaster, kSplit };
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
    if (!IsaSupported(isa)) continue;
    for (Layout layout : {Layout::kFp32, Layout::kOwnMaster, Layout::kSplit}) {
      for (DType md : {DType::kFloat32, DType::kBFloat16}) {
        for (size_t n : {1, 17, 4096, 4099}) {
          INFO(IsaName(isa) << " layout " << static_cast<int>(layout) << " moments "
                            << DTypeName(md) << " n " << n);
          const DType pd = layout == Layout::kOwnMaster ? DType::kFloat32 : DType::kBFloat16;
          const Buffers start = MakeBuffers(n, DType::kBFloat16, md, pd, static_cast<uint32_t>(n));
          std::vector<uint16_t> lo0(n);
          Buffers in_place = start;
          if (layout == Layout::kSplit) {
            auto* hi = reinterpret_cast<uint16_t*>(in_place.out.data());
            for (size_t i = 0; i < n; ++i) SplitMasterEncode(start.master[i], &hi[i], &lo0[i]);
          }
          const Buffers state = in_place;  // the old values, read by the out-of-place step
          std::vector<uint16_t> lo = lo0;
          auto range = [&](Buffers& b, uint16_t* master_lo) {
            AdamWRange r;
            r.exp_avg = b.m.data();
            r.exp_avg_sq = b.v.data();
            r.grad = b.g.data();
            r.numel = n;
            r.grad_dtype = DType::kBFloat16;
            r.moment_dtype = md;
            r.param_dtype = pd;
            if (layout == Layout::kSplit) {
              r.param_out = b.out.data();
              r.master_lo = master_lo;
            } else {
              r.master = b.master.data();
              r.param_out = layout == Layout::kOwnMaster ? static_cast<void*>(b.master.data())
                                                         : static_cast<void*>(b.out.data());
            }
            return r;
          };
          const auto s = ComputeAdamWStepScalars(AdamWHyperParams{}, 4, 0.75f);
          const RoundingKey key{9, 3, 4, 100};
          AdamWUpdate(range(in_place, lo.data()), s, key, isa);

          // Out of place: outputs start as garbage, inputs are a copy of the state.
          Buffers out = state;
          std::fill(out.master.begin(), out.master.end(), -1.0f);
          std::fill(out.m.begin(), out.m.end(), uint8_t{0xAB});
          std::fill(out.v.begin(), out.v.end(), uint8_t{0xCD});
          if (layout == Layout::kSplit) std::fill(out.out.begin(), out.out.end(), uint8_t{0xEF});
          std::vector<uint16_t> out_lo(n, 0x1234);
          const Buffers before = state;
          AdamWRange r = range(out, out_lo.data());
          r.from.master = state.master.data();
          r.from.master_hi = reinterpret_cast<const uint16_t*>(state.out.data());
          r.from.master_lo = lo0.data();
          r.from.exp_avg = state.m.data();
          r.from.exp_avg_sq = state.v.data();
          // Sliced in two, as the journal does: the halves must join up.
          const size_t half = n / 2;
          AdamWUpdate(r.Slice(0, half), s, key, isa);
          RoundingKey key2 = key;
          key2.element_offset += half;
          AdamWUpdate(r.Slice(half, n - half), s, key2, isa);

          CHECK(out.m == in_place.m);
          CHECK(out.v == in_place.v);
          CHECK(out.out == in_place.out);
          if (layout == Layout::kSplit)
            CHECK(out_lo == lo);
          else
            CHECK(out.master == in_place.master);
          CHECK(state.m == before.m);  // the inputs were only read
          CHECK(state.master == before.master);
          CHECK(out.m != state.m);  // and the step did change something
        }
      }
    }
  }
}
