// The element codecs of quant_format.h against brute-force references: NF4's tree vs
// its branch-free count and the published code table; e4m3 and e2m1 against "nearest
// representable value, ties to even, saturating" computed by scanning every code.
#include "trainstream/kernels/quant_format.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "catch_compat.h"

namespace tk = trainstream::kernels;

namespace {

// Nearest code by scanning `values` (non-negative magnitudes, index = code); ties go
// to the even code. Values above the largest saturate.
uint8_t NearestEven(const std::vector<float>& values, float a) {
  int best = 0;
  double best_d = std::fabs(static_cast<double>(a) - values[0]);
  for (int c = 1; c < static_cast<int>(values.size()); ++c) {
    const double d = std::fabs(static_cast<double>(a) - values[c]);
    if (d < best_d || (d == best_d && c % 2 == 0)) {
      best = c;
      best_d = d;
    }
  }
  return static_cast<uint8_t>(best);
}

std::vector<float> RandomProbes(uint32_t seed, int n, float lo_exp, float hi_exp) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> e(lo_exp, hi_exp);
  std::uniform_int_distribution<int> s(0, 1);
  std::vector<float> out;
  for (int i = 0; i < n; ++i) out.push_back((s(rng) ? -1.0f : 1.0f) * std::exp2(e(rng)));
  return out;
}

}  // namespace

TEST_CASE("NF4 code table is bitsandbytes' published table") {
  const float code[16] = {TRAINSTREAM_NF4_CODE_VALUES};
  const double published[16] = {-1.0,
                                -0.6961928009986877,
                                -0.5250730514526367,
                                -0.39491748809814453,
                                -0.28444138169288635,
                                -0.18477343022823334,
                                -0.09105003625154495,
                                0.0,
                                0.07958029955625534,
                                0.16093020141124725,
                                0.24611230194568634,
                                0.33791524171829224,
                                0.44070982933044434,
                                0.5626170039176941,
                                0.7229568362236023,
                                1.0};
  for (int i = 0; i < 16; ++i) REQUIRE(code[i] == static_cast<float>(published[i]));
  // Each code value encodes to itself.
  for (int i = 0; i < 16; ++i) REQUIRE(tk::Nf4Encode(code[i]) == i);
}

TEST_CASE("NF4 tree and branch-free count agree, ties and NaN included") {
  const float t[15] = {TRAINSTREAM_NF4_THRESHOLDS};
  std::vector<float> probes = RandomProbes(1, 200000, -12.0f, 0.5f);
  for (float th : t) {
    probes.push_back(th);
    probes.push_back(std::nextafter(th, 2.0f));
    probes.push_back(std::nextafter(th, -2.0f));
  }
  probes.push_back(std::numeric_limits<float>::quiet_NaN());
  probes.push_back(std::numeric_limits<float>::infinity());
  probes.push_back(-std::numeric_limits<float>::infinity());
  probes.push_back(0.0f);
  probes.push_back(-0.0f);
  for (float v : probes) REQUIRE(int(tk::Nf4Encode(v)) == int(tk::Nf4EncodeCount(v)));
  // A value equal to a threshold takes the lower code (bitsandbytes uses "x > t").
  REQUIRE(tk::Nf4Encode(t[7]) == 7);
  REQUIRE(tk::Nf4Encode(std::nextafter(t[7], 1.0f)) == 8);
  REQUIRE(tk::Nf4Encode(std::numeric_limits<float>::quiet_NaN()) == 0);
}

TEST_CASE("e4m3 encode is round-to-nearest-even with saturation at 448") {
  std::vector<float> mags;
  for (int c = 0; c < 0x7F; ++c) mags.push_back(tk::E4m3Decode(static_cast<uint8_t>(c)));
  REQUIRE(mags[0x7E] == 448.0f);
  REQUIRE(mags[1] == std::exp2(-9.0f));
  REQUIRE(mags[8] == std::exp2(-6.0f));
  for (int c = 0; c < 0x7F; ++c) {
    REQUIRE(tk::E4m3Encode(mags[c]) == c);
    REQUIRE(tk::E4m3Encode(-mags[c]) == (c | 0x80));
  }
  std::vector<float> probes = RandomProbes(2, 200000, -14.0f, 10.0f);
  for (int c = 0; c + 1 < 0x7F; ++c) probes.push_back(0.5f * (mags[c] + mags[c + 1]));  // ties
  for (float x : probes) {
    const uint8_t want =
        static_cast<uint8_t>((std::signbit(x) ? 0x80 : 0) | NearestEven(mags, std::fabs(x)));
    INFO("x = " << x);
    REQUIRE(int(tk::E4m3Encode(x)) == int(want));
  }
  REQUIRE(tk::E4m3Encode(1e30f) == 0x7E);
  REQUIRE(tk::E4m3Encode(std::numeric_limits<float>::infinity()) == 0x7E);
  REQUIRE((tk::E4m3Encode(std::numeric_limits<float>::quiet_NaN()) & 0x7F) == 0x7F);
  REQUIRE(std::isnan(tk::E4m3Decode(0x7F)));
}

TEST_CASE("e2m1 encode is round-to-nearest-even with saturation at 6") {
  const std::vector<float> mags = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  std::vector<float> probes = RandomProbes(3, 100000, -4.0f, 4.0f);
  for (float m : {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f}) {
    probes.push_back(m);
    probes.push_back(-m);
  }
  for (float x : probes) {
    const uint8_t want =
        static_cast<uint8_t>((std::signbit(x) ? 0x8 : 0) | NearestEven(mags, std::fabs(x)));
    INFO("x = " << x);
    REQUIRE(int(tk::E2m1Encode(x)) == int(want));
  }
  const float values[16] = {TRAINSTREAM_E2M1_VALUES};
  for (int c = 0; c < 16; ++c) REQUIRE(tk::E2m1Encode(values[c]) == (c == 8 ? 8 : c));
}

TEST_CASE("e8m0 block scale is the smallest power of two keeping amax/scale <= 448") {
  for (float amax : RandomProbes(4, 100000, -100.0f, 120.0f)) {
    amax = std::fabs(amax);
    const uint8_t c = tk::E8m0ScaleForAmax(amax, amax / 448.0f);
    const float s = tk::E8m0Decode(c);
    INFO("amax = " << amax);
    REQUIRE(amax / s <= 448.0f * (1.0f + 1e-6f));
    REQUIRE(amax / (s * 0.5f) > 448.0f * (1.0f - 1e-6f));
    REQUIRE(tk::E8m0InverseDecode(c) * s == 1.0f);
  }
  REQUIRE(tk::E8m0ScaleForAmax(448.0f, 1.0f) == 127);  // exactly 448: scale 1
  REQUIRE(tk::E8m0ScaleForAmax(0.0f, 0.0f) == 0);
}

TEST_CASE("bf16 conversion rounds to nearest even and keeps subnormals") {
  REQUIRE(tk::FloatToBf16Bits(1.0f) == 0x3F80);
  REQUIRE(tk::FloatToBf16Bits(tk::BitsFloat(0x3F808000u)) == 0x3F80);  // tie -> even
  REQUIRE(tk::FloatToBf16Bits(tk::BitsFloat(0x3F818000u)) == 0x3F82);  // tie -> even
  REQUIRE(tk::FloatToBf16Bits(tk::BitsFloat(0x00010000u)) == 0x0001);  // subnormal kept
}
