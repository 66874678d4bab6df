// Internal to the AdamW kernels: the per-ISA entry points adamw.cc dispatches
// to, and the scalar per-element step every path must reproduce bit for bit.
#pragma once

#include <cmath>
#include <cstdint>

#include "trainstream/kernels/adamw.h"
#include "trainstream/kernels/counter_rng.h"
#include "trainstream/kernels/fused_multiply_add.h"

namespace trainstream::kernels::internal {

// Ranges passed here never cross a 2^32 element-index boundary (adamw.cc splits
// them), so the element index of element i is index_lo + i in uint32.
using UpdateFn = void (*)(const AdamWRange& r, const AdamWStepScalars& s, RngKey key,
                          uint32_t index_lo);
using SumSquaresFn = double (*)(const void* grad, DType dtype, size_t n);

void AdamWUpdateScalar(const AdamWRange& r, const AdamWStepScalars& s, RngKey key,
                       uint32_t index_lo);
void AdamWUpdateAvx2(const AdamWRange& r, const AdamWStepScalars& s, RngKey key, uint32_t index_lo);
void AdamWUpdateAvx512(const AdamWRange& r, const AdamWStepScalars& s, RngKey key,
                       uint32_t index_lo);

double GradSumSquaresScalar(const void* grad, DType dtype, size_t n);
double GradSumSquaresAvx2(const void* grad, DType dtype, size_t n);
double GradSumSquaresAvx512(const void* grad, DType dtype, size_t n);

// What a step reads (AdamWRange::from): each array named there or, where it names
// nothing, the one the step writes (in place). A split master's high halves are
// param_out.
inline AdamWRange::Inputs InputsOf(const AdamWRange& r) {
  const AdamWRange::Inputs& f = r.from;
  return {f.master != nullptr ? f.master : r.master,
          f.master_hi != nullptr ? f.master_hi : static_cast<const uint16_t*>(r.param_out),
          f.master_lo != nullptr ? f.master_lo : r.master_lo,
          f.exp_avg != nullptr ? f.exp_avg : r.exp_avg,
          f.exp_avg_sq != nullptr ? f.exp_avg_sq : r.exp_avg_sq};
}

// Note [AdamW operation order]: torch 2.11 _single_tensor_adam on CPU runs
//   param.mul_(1 - lr*wd); exp_avg.lerp_(grad, 1 - beta1);
//   exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2);
//   denom = (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps);
//   param.addcdiv_(exp_avg, denom, value=-step_size)
// whose vectorized CPU kernels compute lerp as fma(coeff, end - self, base) and
// addcmul as self + (value * t1) * t2, each rounded to float. We do the same for
// the decay and both moments, so exp_avg and exp_avg_sq are bit-identical to
// torch's. For the parameter we multiply numerator and denominator by bc2_sqrt:
//   param + (-(step_size * bc2_sqrt) * m) / (sqrt(v) + eps * bc2_sqrt)
// (the two scalars computed in double, rounded once), which is the same value up
// to a few float roundings of the update (|relative error| < 4 ulp of the update,
// i.e. ~1e-10 absolute for lr 1e-3) and saves one of the two divisions per
// element. Every path uses exactly these operations in this order (one fused
// multiply-add, in lerp), so all paths agree bit for bit.
inline void AdamWElement(float g, float* p, float* m, float* v, const AdamWStepScalars& s) {
  g = g * s.grad_scale;
  float param = *p * s.decay;
  const float diff = g - *m;
  // Note [A correctly rounded fmaf on every platform] (fused_multiply_add.h).
  const float exp_avg = Fmaf(s.lerp_coeff, diff, s.lerp_from_end ? g : *m);
  float exp_avg_sq = *v * s.beta2;
  exp_avg_sq = exp_avg_sq + (s.one_minus_beta2 * g) * g;
  const float denom = std::sqrt(exp_avg_sq) + s.eps_scaled;
  param = param + (s.neg_step_scaled * exp_avg) / denom;
  *p = param;
  *m = exp_avg;
  *v = exp_avg_sq;
}

}  // namespace trainstream::kernels::internal
