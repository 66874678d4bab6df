// The float fused multiply-add the CPU kernels use (Note [AdamW operation
// order], kernels/cpu/adamw_impl.h): the one seam where the C library's fmaf
// differs by platform.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace trainstream::kernels {

// a * b + c rounded once to float (round to nearest even), from double
// arithmetic alone. The product of two floats is exact in a double (48 of 53
// bits); the sum is rounded to a double with round to odd (the nearest double,
// moved one ulp towards the exact sum when it is inexact and even), and a
// double rounded to odd with 53 >= 24 + 2 bits rounds to the same float as the
// exact value. Assumes the default rounding mode, like the kernels.
inline float PortableFmaf(float a, float b, float c) {
  const double product = static_cast<double>(a) * static_cast<double>(b);
  double sum = product + static_cast<double>(c);
  if (!std::isfinite(sum)) return static_cast<float>(sum);
  // Knuth's TwoSum: the exact rounding error of product + c.
  const double c_part = sum - product;
  const double error = (product - (sum - c_part)) + (static_cast<double>(c) - c_part);
  if (error != 0) {
    uint64_t bits;
    std::memcpy(&bits, &sum, sizeof(bits));
    if ((bits & 1) == 0) {
      // The exact sum lies strictly between sum and its neighbour on error's
      // side, which is odd: one step up in magnitude when error has sum's sign.
      bits = ((error > 0) == (sum > 0)) ? bits + 1 : bits - 1;
      std::memcpy(&sum, &bits, sizeof(sum));
    }
  }
  return static_cast<float>(sum);
}

// Note [A correctly rounded fmaf on every platform]: every AdamW path must
// agree bit for bit, so the scalar path's fma must round like the SIMD paths'
// vfmadd instruction. Compiled with FMA enabled, std::fma is that instruction;
// glibc's fmaf is correctly rounded too. MinGW-w64's is not (measured under
// wine64: about 1 in 10 float triples of random bits came out differently, and
// the scalar AdamW path then differed from the AVX2 and AVX-512 paths), so a
// MinGW-w64 build without FMA uses PortableFmaf. The test is of the C library
// (the toolchain), not of the operating system, so it names MinGW, not Windows.
// fused_multiply_add_test checks both functions against the instruction.
inline float Fmaf(float a, float b, float c) {
#if defined(__MINGW32__) && !defined(__FMA__)
  return PortableFmaf(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

}  // namespace trainstream::kernels
