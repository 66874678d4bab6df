// Internal to the AdamW kernels: the per-ISA entry points adamw.cc dispatches
// to, and the scalar per-element step every path must reproduce bit for bit.
#pragma once

#include <cmath>
#include <cstdint>

#include "trainstream/kernels/adamw.h"
#include "trainstream/kernels/counter_rng.h"

namespace trainstream::kernels::internal {

// Ranges passed here never cross a 2^32 element-index boundary (adamw.cc splits
// them), so the element index of element i is index_lo + i in uint32.
using UpdateFn = void (*)(const AdamWRange& r, const AdamWStepScalars& s, RngKey key,
                          uint32_t index_lo);
using SumSquaresFn = double (*)(const void* grad, DType dtype, size_t n);

void AdamWUpdateScalar(const AdamWRange& r, const AdamWStepScalars& s, RngKey key,
                       uint32_t index_lo);
void AdamWUpdateAvx2(const AdamWRange& r, const AdamWStepScalars& s, RngKey key,
                     uint32_t index_lo);
void AdamWUpdateAvx512(const AdamWRange& r, const AdamWStepScalars& s, RngKey key,
                       uint32_t index_lo);

double GradSumSquaresScalar(const void* grad, DType dtype, size_t n);
double GradSumSquaresAvx2(const void* grad, DType dtype, size_t n);
double GradSumSquaresAvx512(const void* grad, DType dtype, size_t n);

// Note [AdamW operation order]: torch 2.11 _single_tensor_adam on CPU runs
//   param.mul_(1 - lr*wd); exp_avg.lerp_(grad, 1 - beta1);
//   exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2);
//   denom = (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps);
//   param.addcdiv_(exp_avg, denom, value=-step_size)
// whose vectorized CPU kernels compute lerp as fma(coeff, end - self, base),
// addcmul as self + (value * t1) * t2 and addcdiv as self + (value * t1) / t2,
// each rounded to float. The SIMD paths use the same operations in the same
// order (one fused multiply-add, in lerp), so all paths agree bit for bit.
inline void AdamWElement(float g, float* p, float* m, float* v, const AdamWStepScalars& s) {
  g = g * s.grad_scale;
  float param = *p * s.decay;
  const float diff = g - *m;
  const float exp_avg = std::fma(s.lerp_coeff, diff, s.lerp_from_end ? g : *m);
  float exp_avg_sq = *v * s.beta2;
  exp_avg_sq = exp_avg_sq + (s.one_minus_beta2 * g) * g;
  const float denom = std::sqrt(exp_avg_sq) / s.bias_correction2_sqrt + s.eps;
  param = param + (s.neg_step_size * exp_avg) / denom;
  *p = param;
  *m = exp_avg;
  *v = exp_avg_sq;
}

}  // namespace trainstream::kernels::internal
