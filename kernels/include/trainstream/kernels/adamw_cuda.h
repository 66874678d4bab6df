// Zero-copy AdamW on CUDA (optimizer_mode="gpu"): the kernel updates a parameter
// in place in VRAM while it reads and writes the moments (and the fp32 master,
// when the parameter is not fp32) in pinned host memory mapped into the device's
// address space, so only the moments cross PCIe and no host thread does work.
//
// The arithmetic is the CPU kernels' (Note [AdamW operation order] in
// kernels/cpu/adamw_impl.h) with every rounding explicit, and bf16 moments use
// the same counter-based stochastic rounding keyed by (seed, param_key, step,
// element index): for the same inputs a parameter updated here and one updated by
// the daemon's engine hold the same bits.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "trainstream/kernels/adamw.h"

namespace trainstream::kernels {

// One whole parameter. Device-accessible pointers (device memory, or mapped
// pinned host memory); none aliases another.
struct AdamWCudaTensors {
  void* param = nullptr;       // param_dtype, updated in place
  const void* grad = nullptr;  // grad_dtype
  float* master = nullptr;     // fp32 master; null when param_dtype is fp32 (param is the master)
  void* exp_avg = nullptr;     // moment_dtype
  void* exp_avg_sq = nullptr;  // moment_dtype
  size_t numel = 0;
  DType param_dtype = DType::kFloat32;
  DType grad_dtype = DType::kFloat32;
  DType moment_dtype = DType::kFloat32;  // kFloat32 or kBFloat16
};

// Enqueues one AdamW step of `t` on `stream`. When `skip` (a device int32) is
// non-null and holds a non-zero value once the kernel runs, nothing is written.
// Returns the launch error, or cudaSuccess; does not synchronize.
cudaError_t AdamWUpdateCuda(const AdamWCudaTensors& t, const AdamWStepScalars& scalars,
                            uint64_t seed, uint64_t param_key, uint64_t step, const int32_t* skip,
                            cudaStream_t stream);

// Sets *flag (device int32) to 1 if any of the `numel` gradient elements is NaN
// or infinite; never clears it. Enqueued on `stream`.
cudaError_t FlagNonFiniteCuda(const void* grad, DType grad_dtype, size_t numel, int32_t* flag,
                              cudaStream_t stream);

}  // namespace trainstream::kernels
