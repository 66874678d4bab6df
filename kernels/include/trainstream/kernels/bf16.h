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

// Note [Split master]
// An fp32 master weight x can be kept as two uint16 halves: hi = FloatToBf16Rne(x), the
// bf16 weight the GPU trains with (the same bits as tensor.to(torch.bfloat16)), and
// lo = the low 16 bits of x. Then the weight copy for the GPU is part of the master and
// is not written separately: 2 bytes a parameter less traffic per step. x's upper 16 bits
// are hi when rounding went down and hi - 1 when it went up, which lo tells apart: lo
// above 0x8000 rounded up, below it rounded down. At exactly 0x8000 (a tie) both are
// possible, and only the tie that rounded down keeps that code; a tie that rounded up is
// stored as lo = 0x8001, i.e. the master moves one fp32 ulp away from zero (about one
// element in 2^17 per step). Infinity and the largest finite values decode exactly;
// a NaN stays a NaN.
TS_HOST_DEVICE inline void SplitMasterEncode(float x, uint16_t* hi, uint16_t* lo) {
  const uint32_t u = FloatBits(x);
  const uint16_t h = FloatToBf16Rne(x);
  uint16_t l = static_cast<uint16_t>(u & 0xFFFFu);
  if (l == 0x8000u && (u >> 16) != h) l = 0x8001u;
  *hi = h;
  *lo = l;
}

TS_HOST_DEVICE inline float SplitMasterDecode(uint16_t hi, uint16_t lo) {
  const uint32_t upper = static_cast<uint32_t>(hi) - (lo > 0x8000u ? 1u : 0u);
  return BitsToFloat((upper << 16) | lo);
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
