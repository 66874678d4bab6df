// AdamW update kernel (torch.optim.AdamW math, decoupled weight decay) over one
// contiguous range of one parameter, in a single pass over memory. Pure compute:
// no threads, no allocation. The daemon's engine (daemon/optimizer/) splits
// parameters into ranges and runs this on its worker threads; docs/adamw.md has
// the math, precisions and error bounds.
#pragma once

#include <cstddef>
#include <cstdint>

#include "trainstream/kernels/cpu_features.h"
#include "trainstream/wire/dtype.h"

namespace trainstream::kernels {

// The kernels take the wire's DType as it arrives (Note [DType numbers are the wire's]),
// named and parsed as the wire names them (DTypeName, ParseDType: wire/dtype.h).
using wire::DType;
using wire::DTypeName;
using wire::DTypeSize;
using wire::ParseDType;

// Hyper-parameters of one step of one parameter (they arrive with every step, so
// schedulers and parameter groups need nothing else).
struct AdamWHyperParams {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
};

// The per-(parameter, step) scalars, derived in double exactly as torch's
// _single_tensor_adam does in Python floats, then rounded to float as torch's CPU
// kernels do when a Python scalar meets a float tensor.
struct AdamWStepScalars {
  float grad_scale;    // clip coefficient applied to the gradient first (1: none)
  float decay;         // 1 - lr * weight_decay
  float lerp_coeff;    // torch lerp_: weight (= 1 - beta1) if < 0.5, else weight - 1
  bool lerp_from_end;  // weight >= 0.5: lerp is computed from the end (the gradient)
  float beta2;
  float one_minus_beta2;
  float bias_correction2_sqrt;
  float eps;
  float neg_step_size;  // -lr / (1 - beta1^step)
  // What the kernels use (Note [AdamW operation order] in adamw_impl.h): the
  // bias correction folded into the two scalars, so one division per element
  // instead of two. Both are computed in double and rounded once.
  float eps_scaled;       // eps * sqrt(1 - beta2^step)
  float neg_step_scaled;  // -lr / (1 - beta1^step) * sqrt(1 - beta2^step)
};

// `step` counts from 1 (the value of torch's state['step'] after its increment).
AdamWStepScalars ComputeAdamWStepScalars(const AdamWHyperParams& hp, uint64_t step,
                                         float grad_scale);

// One contiguous range [element_offset, element_offset + numel) of a parameter.
// All pointers address element 0 of the range; none may alias another except
// that param_out may equal master when param_dtype is fp32 (the output is then
// the master itself and is written once). param_out may be null (no output).
struct AdamWRange {
  float* master = nullptr;     // null with a split master
  void* exp_avg = nullptr;     // moment_dtype
  void* exp_avg_sq = nullptr;  // moment_dtype
  const void* grad = nullptr;  // grad_dtype
  void* param_out = nullptr;   // param_dtype, rounded to nearest even
  size_t numel = 0;
  DType grad_dtype = DType::kFloat32;
  DType moment_dtype = DType::kFloat32;  // kFloat32 or kBFloat16 (stochastic rounding)
  DType param_dtype = DType::kFloat32;
  // A split master (Note [Split master] in bf16.h): master is null and the fp32 master is
  // (param_out, master_lo), param_out in bf16, both read and written in place.
  uint16_t* master_lo = nullptr;

  // Where the step reads the old master and moments when they are not the arrays it
  // writes (the redo journal, Note [Redo journal] in trainstream/optimizer/
  // journaled_update.h): each null member reads the array it names above, in place.
  // A split master's old value is (master_hi, master_lo); an fp32 one's is master.
  struct Inputs {
    const float* master = nullptr;
    const uint16_t* master_hi = nullptr;
    const uint16_t* master_lo = nullptr;
    const void* exp_avg = nullptr;
    const void* exp_avg_sq = nullptr;
  };
  Inputs from;

  // Elements [offset, offset + n) of this range, every array advanced alike (a
  // param_out that is the master stays the master).
  AdamWRange Slice(size_t offset, size_t n) const;
};

// Keys the stochastic rounding of bf16 moments: the random bits of an element
// are a function of (seed, param_key, step, element_offset + i) only.
struct RoundingKey {
  uint64_t seed = 0;
  uint64_t param_key = 0;
  uint64_t step = 0;
  uint64_t element_offset = 0;
};

// Applies one AdamW step to the range. `isa` must satisfy IsaSupported(isa)
// (the caller resolves it once, normally with BestIsa()). Every path produces
// bit-identical results for the same inputs (scalar is the reference), except
// that the AVX-512 BF16 instruction flushes subnormal bf16 outputs to zero.
void AdamWUpdate(const AdamWRange& range, const AdamWStepScalars& scalars, const RoundingKey& key,
                 Isa isa);

// Sum of squares of the gradient, accumulated in double. Its result is finite iff
// every element is finite (a finite float squared cannot overflow a double), so
// one pass gives both the L2 norm contribution and the non-finite check.
double GradSumSquares(const void* grad, DType grad_dtype, size_t numel, Isa isa);

// Converts `numel` elements of `src` (any DType) to fp32 `dst` (exact).
void ConvertToFloat(const void* src, DType src_dtype, float* dst, size_t numel);

// Rounds fp32 `src` to bf16 with the same stochastic rounding the kernel applies
// to exp_avg (`use_high_bits` false) or exp_avg_sq (true); for tests and for
// importing fp32 state into bf16 moments.
void StochasticRoundToBf16(const float* src, uint16_t* dst, size_t numel, const RoundingKey& key,
                           bool use_high_bits);

}  // namespace trainstream::kernels
