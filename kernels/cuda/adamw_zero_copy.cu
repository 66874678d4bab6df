// Zero-copy AdamW (adamw_cuda.h). Memory-bound on PCIe: each thread handles
// consecutive elements of a grid-stride loop so that a warp's moment reads and
// writes are 128-byte transactions over the link.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "trainstream/kernels/adamw_cuda.h"
#include "trainstream/kernels/bf16.h"
#include "trainstream/kernels/counter_rng.h"

namespace trainstream::kernels {
namespace {

__device__ __forceinline__ float LoadAs(const void* base, DType dtype, size_t i) {
  switch (dtype) {
    case DType::kBFloat16:
      return Bf16ToFloat(static_cast<const uint16_t*>(base)[i]);
    case DType::kFloat16:
      return __half2float(static_cast<const __half*>(base)[i]);
    case DType::kFloat32:
      break;
  }
  return static_cast<const float*>(base)[i];
}

__device__ __forceinline__ void StoreAs(void* base, DType dtype, size_t i, float x) {
  switch (dtype) {
    case DType::kBFloat16:
      static_cast<uint16_t*>(base)[i] = FloatToBf16Rne(x);
      return;
    case DType::kFloat16:
      // __float2half_rn: round to nearest even, overflow to inf, subnormals kept;
      // the same bits as FloatToFp16Rne and torch's .to(torch.float16).
      static_cast<__half*>(base)[i] = __float2half_rn(x);
      return;
    case DType::kFloat32:
      static_cast<float*>(base)[i] = x;
      return;
  }
}

// AdamWElement (kernels/cpu/adamw_impl.h) with each rounding spelled out so that
// nvcc cannot contract a multiply and an add into one FMA.
__device__ __forceinline__ void Element(float g, float* p, float* m, float* v,
                                        const AdamWStepScalars& s) {
  g = __fmul_rn(g, s.grad_scale);
  float param = __fmul_rn(*p, s.decay);
  const float diff = __fsub_rn(g, *m);
  const float exp_avg = __fmaf_rn(s.lerp_coeff, diff, s.lerp_from_end ? g : *m);
  float exp_avg_sq = __fmul_rn(*v, s.beta2);
  exp_avg_sq = __fadd_rn(exp_avg_sq, __fmul_rn(__fmul_rn(s.one_minus_beta2, g), g));
  const float denom = __fadd_rn(__fsqrt_rn(exp_avg_sq), s.eps_scaled);
  param = __fadd_rn(param, __fdiv_rn(__fmul_rn(s.neg_step_scaled, exp_avg), denom));
  *p = param;
  *m = exp_avg;
  *v = exp_avg_sq;
}

// Elements [base, base + n) of the parameter, all with element index >> 32 equal
// (the RNG key depends on it).
__global__ void AdamWKernel(AdamWCudaTensors t, AdamWStepScalars s, RngKey key, size_t base,
                            size_t n, const int32_t* skip) {
  if (skip != nullptr && *skip != 0) return;
  const bool bf16_moments = t.moment_dtype == DType::kBFloat16;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t j = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < n; j += stride) {
    const size_t i = base + j;
    const float g = LoadAs(t.grad, t.grad_dtype, i);
    float m = LoadAs(t.exp_avg, t.moment_dtype, i);
    float v = LoadAs(t.exp_avg_sq, t.moment_dtype, i);
    float p = t.master != nullptr ? t.master[i] : static_cast<const float*>(t.param)[i];
    Element(g, &p, &m, &v, s);
    if (bf16_moments) {
      const uint32_t bits = CounterRandom(key, static_cast<uint32_t>(i));
      static_cast<uint16_t*>(t.exp_avg)[i] = FloatToBf16Stochastic(m, bits);
      static_cast<uint16_t*>(t.exp_avg_sq)[i] = FloatToBf16Stochastic(v, bits >> 16);
    } else {
      static_cast<float*>(t.exp_avg)[i] = m;
      static_cast<float*>(t.exp_avg_sq)[i] = v;
    }
    if (t.master != nullptr) t.master[i] = p;
    StoreAs(t.param, t.param_dtype, i, p);
  }
}

// Four consecutive elements at once: 16-byte fp32 or 8-byte 16-bit accesses, so a
// warp's requests over PCIe are 512 or 256 bytes instead of 128 (fewer, larger
// read requests keep more of the link busy). Elements [base, base + 4 * n4);
// every pointer is aligned for these accesses (AdamWUpdateCuda checks).
__device__ __forceinline__ void Load4(const void* p, DType dtype, size_t i, float out[4]) {
  if (dtype == DType::kFloat32) {
    const float4 v = reinterpret_cast<const float4*>(p)[i / 4];
    out[0] = v.x;
    out[1] = v.y;
    out[2] = v.z;
    out[3] = v.w;
    return;
  }
  const uint2 v = reinterpret_cast<const uint2*>(p)[i / 4];
  const uint16_t h[4] = {static_cast<uint16_t>(v.x), static_cast<uint16_t>(v.x >> 16),
                         static_cast<uint16_t>(v.y), static_cast<uint16_t>(v.y >> 16)};
  for (int k = 0; k < 4; ++k) {
    out[k] = dtype == DType::kBFloat16 ? Bf16ToFloat(h[k]) : __half2float(__ushort_as_half(h[k]));
  }
}

__device__ __forceinline__ void Store4Bits(void* p, DType dtype, size_t i, const uint16_t h[4]) {
  (void)dtype;
  reinterpret_cast<uint2*>(p)[i / 4] = make_uint2(h[0] | (static_cast<uint32_t>(h[1]) << 16),
                                                  h[2] | (static_cast<uint32_t>(h[3]) << 16));
}

__device__ __forceinline__ void Store4(void* p, DType dtype, size_t i, const float x[4]) {
  if (dtype == DType::kFloat32) {
    reinterpret_cast<float4*>(p)[i / 4] = make_float4(x[0], x[1], x[2], x[3]);
    return;
  }
  uint16_t h[4];
  for (int k = 0; k < 4; ++k) {
    h[k] =
        dtype == DType::kBFloat16 ? FloatToBf16Rne(x[k]) : __half_as_ushort(__float2half_rn(x[k]));
  }
  Store4Bits(p, dtype, i, h);
}

__global__ void AdamWKernelVec4(AdamWCudaTensors t, AdamWStepScalars s, RngKey key, size_t base,
                                size_t n4, const int32_t* skip) {
  if (skip != nullptr && *skip != 0) return;
  const bool bf16_moments = t.moment_dtype == DType::kBFloat16;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t j = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < n4; j += stride) {
    const size_t i = base + 4 * j;
    float g[4], m[4], v[4], p[4];
    Load4(t.grad, t.grad_dtype, i, g);
    Load4(t.exp_avg, t.moment_dtype, i, m);
    Load4(t.exp_avg_sq, t.moment_dtype, i, v);
    if (t.master != nullptr) {
      Load4(t.master, DType::kFloat32, i, p);
    } else {
      Load4(t.param, DType::kFloat32, i, p);
    }
    for (int k = 0; k < 4; ++k) Element(g[k], &p[k], &m[k], &v[k], s);
    if (bf16_moments) {
      uint16_t hm[4], hv[4];
      for (int k = 0; k < 4; ++k) {
        const uint32_t bits = CounterRandom(key, static_cast<uint32_t>(i + k));
        hm[k] = FloatToBf16Stochastic(m[k], bits);
        hv[k] = FloatToBf16Stochastic(v[k], bits >> 16);
      }
      Store4Bits(t.exp_avg, DType::kBFloat16, i, hm);
      Store4Bits(t.exp_avg_sq, DType::kBFloat16, i, hv);
    } else {
      Store4(t.exp_avg, DType::kFloat32, i, m);
      Store4(t.exp_avg_sq, DType::kFloat32, i, v);
    }
    if (t.master != nullptr) Store4(t.master, DType::kFloat32, i, p);
    Store4(t.param, t.param_dtype, i, p);
  }
}

__global__ void NonFiniteKernel(const void* grad, DType dtype, size_t n, int32_t* flag) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  bool bad = false;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    bad |= !isfinite(LoadAs(grad, dtype, i));
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0) *flag = 1;
}

constexpr int kThreads = 256;

int Blocks(size_t n) {
  // Enough blocks to keep every SM's memory pipeline full on a large tensor;
  // the grid-stride loop covers the rest.
  const size_t want = (n + kThreads - 1) / kThreads;
  return static_cast<int>(want < 4096 ? (want == 0 ? 1 : want) : 4096);
}

// Whether every array is aligned for Load4/Store4 at element 0 (then also at
// every multiple of 4).
bool Vec4Ok(const AdamWCudaTensors& t) {
  const auto aligned = [](const void* p, DType d) {
    const size_t elem = d == DType::kFloat32 ? 4 : 2;
    return p == nullptr || reinterpret_cast<uintptr_t>(p) % (4 * elem) == 0;
  };
  return aligned(t.param, t.param_dtype) && aligned(t.grad, t.grad_dtype) &&
         aligned(t.master, DType::kFloat32) && aligned(t.exp_avg, t.moment_dtype) &&
         aligned(t.exp_avg_sq, t.moment_dtype);
}

}  // namespace

cudaError_t AdamWUpdateCuda(const AdamWCudaTensors& t, const AdamWStepScalars& scalars,
                            uint64_t seed, uint64_t param_key, uint64_t step, const int32_t* skip,
                            cudaStream_t stream) {
  if (t.param_dtype == DType::kFloat32 && t.master != nullptr) return cudaErrorInvalidValue;
  if (t.param_dtype != DType::kFloat32 && t.master == nullptr) return cudaErrorInvalidValue;
  if (t.moment_dtype == DType::kFloat16) return cudaErrorInvalidValue;
  constexpr size_t kSpan = size_t{1} << 32;
  for (size_t base = 0; base < t.numel; base += kSpan) {
    const size_t n = t.numel - base < kSpan ? t.numel - base : kSpan;
    const RngKey key = MakeRngKey(seed, param_key, step, static_cast<uint32_t>(base >> 32));
    const size_t n4 = Vec4Ok(t) ? n / 4 : 0;
    if (n4 > 0) {
      AdamWKernelVec4<<<Blocks(n4), kThreads, 0, stream>>>(t, scalars, key, base, n4, skip);
      cudaError_t err = cudaGetLastError();
      if (err != cudaSuccess) return err;
    }
    if (n > 4 * n4) {
      AdamWKernel<<<Blocks(n - 4 * n4), kThreads, 0, stream>>>(t, scalars, key, base + 4 * n4,
                                                               n - 4 * n4, skip);
      const cudaError_t err = cudaGetLastError();
      if (err != cudaSuccess) return err;
    }
  }
  return cudaSuccess;
}

cudaError_t FlagNonFiniteCuda(const void* grad, DType grad_dtype, size_t numel, int32_t* flag,
                              cudaStream_t stream) {
  if (numel == 0) return cudaSuccess;
  NonFiniteKernel<<<Blocks(numel), kThreads, 0, stream>>>(grad, grad_dtype, numel, flag);
  return cudaGetLastError();
}

}  // namespace trainstream::kernels
