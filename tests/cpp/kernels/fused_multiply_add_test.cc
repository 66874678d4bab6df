// Note [A correctly rounded fmaf on every platform]: PortableFmaf and Fmaf
// against the FMA instruction (one rounding, by definition), on edge cases and
// on float triples of random bits.
#include "trainstream/kernels/fused_multiply_add.h"

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "catch_compat.h"
#include "trainstream/kernels/bf16.h"
#include "trainstream/kernels/cpu_features.h"

using namespace trainstream::kernels;

namespace {

__attribute__((target("fma"))) float InstructionFma(float a, float b, float c) {
  return _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(a), _mm_set_ss(b), _mm_set_ss(c)));
}

// Bits equal, or both NaN (the NaN's payload is not part of the contract).
bool SameResult(float x, float y) {
  return FloatBits(x) == FloatBits(y) || (std::isnan(x) && std::isnan(y));
}

void CheckTriple(float a, float b, float c) {
  const float want = InstructionFma(a, b, c);
  INFO("a " << FloatBits(a) << " b " << FloatBits(b) << " c " << FloatBits(c) << " want "
            << FloatBits(want));
  CHECK(SameResult(PortableFmaf(a, b, c), want));
  CHECK(SameResult(Fmaf(a, b, c), want));
}

}  // namespace

TEST_CASE("PortableFmaf and Fmaf round like the FMA instruction", "[fma]") {
  if (!IsaSupported(Isa::kAvx2)) TS_SKIP("CPU lacks FMA: no instruction to compare with");
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float tiny = std::numeric_limits<float>::denorm_min();
  const float big = std::numeric_limits<float>::max();
  const float eps = std::numeric_limits<float>::epsilon();
  const std::vector<float> edges = {0.f,  -0.f,  1.f,    -1.f, 1.f + eps, 1.f - eps / 2,
                                    tiny, -tiny, 1e-38f, big,  -big,      inf,
                                    -inf, nan,   0.1f,   3.f,  0.5f,      2.f + 2 * eps};
  for (float a : edges)
    for (float b : edges)
      for (float c : edges) CheckTriple(a, b, c);
  // A sum rounded twice (to double, then to float) goes wrong here: the exact
  // a * b + c is 1 + 2^-23 + 2^-24 - 2^-60, just below the tie between two
  // floats; as a double it is the tie, which rounds to even, one ulp up.
  const float a = 0x1.00004p-24f, b = 1.f - 0x1p-18f, c = 1.f + eps;
  CHECK(static_cast<float>(static_cast<double>(a) * b + c) != InstructionFma(a, b, c));
  CheckTriple(a, b, c);

  std::mt19937 rng(2026);
  std::uniform_int_distribution<uint32_t> bits;
  std::normal_distribution<float> normal(0.f, 1.f);
  uint64_t mismatches = 0;
  for (int i = 0; i < 1000000; ++i) {
    const bool random_bits = i % 2 == 0;
    const float x = random_bits ? BitsToFloat(bits(rng)) : normal(rng);
    const float y = random_bits ? BitsToFloat(bits(rng)) : normal(rng);
    const float z = random_bits ? BitsToFloat(bits(rng)) : normal(rng);
    const float want = InstructionFma(x, y, z);
    if (!SameResult(PortableFmaf(x, y, z), want) || !SameResult(Fmaf(x, y, z), want)) {
      if (++mismatches <= 5) CheckTriple(x, y, z);  // names the first few
    }
  }
  CHECK(mismatches == 0);
}
