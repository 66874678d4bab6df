// Scalar float <-> bf16 / fp16 conversions shared by every AdamW path. The SIMD
// paths must produce the same bits as these (tests compare them).
#pragma once

#include <cstdint>
#include <cstring>

#include "trainstream/kernels/host_device.h"

namespace trainstream::kernels {

TS_HOST_DEVICE inline uint32_t FloatBits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

TS_HOST_DEVICE inline float BitsToFloat(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

TS_HOST_DEVICE inline float Bf16ToFloat(uint16_t h) {
  return BitsToFloat(static_cast<uint32_t>(h) << 16);
}

// Round to nearest even, NaN -> 0x7FC0: bit-identical to torch's
// c10::BFloat16 constructor (tensor.to(torch.bfloat16)).
TS_HOST_DEVICE inline uint16_t FloatToBf16Rne(float f) {
  uint32_t u = FloatBits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// Stochastic rounding: adding 16 uniform random bits below the bf16 mantissa and
// truncating rounds up with probability (dropped bits) / 2^16, which makes the
// expected value exactly the fp32 input. Infinity stays infinity.
TS_HOST_DEVICE inline uint16_t FloatToBf16Stochastic(float f, uint32_t random16) {
  uint32_t u = FloatBits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  return static_cast<uint16_t>((u + (random16 & 0xFFFFu)) >> 16);
}

// IEEE half conversions (after Maratyszcza's FP16 library): round to nearest
// even, overflow to infinity, subnormals kept; same bits as F16C vcvtps2ph with
// _MM_FROUND_TO_NEAREST_INT and as torch's .to(torch.float16).
inline float Fp16ToFloat(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const uint32_t exp_offset = 0xE0u << 23;
  const float normalized = BitsToFloat((two_w >> 4) + exp_offset) * 0x1.0p-112f;
  const float denormalized = BitsToFloat((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t result =
      sign | (two_w < (1u << 27) ? FloatBits(denormalized) : FloatBits(normalized));
  return BitsToFloat(result);
}

inline uint16_t FloatToFp16Rne(float f) {
  float base = (__builtin_fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = FloatBits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = BitsToFloat((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = FloatBits(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

}  // namespace trainstream::kernels
