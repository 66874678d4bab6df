// The byte-level definition of TrainStream's four quantized formats, shared by the
// CPU kernels (the daemon quantizes while loading a base) and the CUDA kernels (the
// client dequantizes). Everything that decides a stored byte lives here, written once
// as __host__ __device__ code, so the two sides cannot drift apart.
//
// Note [Identical bytes on CPU and CUDA]
// Every quantize path is a fixed sequence of single IEEE-754 fp32 operations (abs,
// max, one correctly rounded division or multiplication, comparisons, integer bit
// manipulation, round-to-nearest-even). No expression has the shape a*b+c, so FMA
// contraction cannot change a result; CUDA code spells the divisions and products as
// __fdiv_rn/__fmul_rn anyway. No fast-math, no flush-to-zero: subnormal inputs keep
// their exact values on both sides. docs/quantization.md describes the formats.
#pragma once

#include <math.h>

#include <cstdint>
#include <cstring>

// Internal linkage on purpose: the CPU kernels compile this header into scalar, AVX2
// and AVX-512 translation units, and an inline function with external linkage would
// let the linker keep one copy (possibly the AVX-512 one) for all of them.
#if defined(__CUDACC__)
#define TS_QUANT_HD static __host__ __device__ __forceinline__
#else
#define TS_QUANT_HD static inline
#endif

namespace trainstream::kernels {

enum class QuantFormat : int {
  kInt8 = 0,   // int8 symmetric, fp32 absmax per block (block: any even size >= 2)
  kNf4 = 1,    // bitsandbytes NF4 codes, 2 per byte, fp32 absmax per block
  kFp8 = 2,    // e4m3 codes, one e8m0 (power of two) scale per 32 elements
  kNvfp4 = 3,  // e2m1 codes, 2 per byte, e4m3 scale per 16 plus an fp32 tensor scale
};

constexpr int64_t kDefaultQuantBlock = 64;  // int8 and nf4
constexpr int64_t kFp8Block = 32;           // fixed by the format (MX block)
constexpr int64_t kNvfp4Block = 16;         // fixed by the format
constexpr float kE4m3Max = 448.0f;
constexpr float kE2m1Max = 6.0f;

// ---- NF4 ------------------------------------------------------------------------
// bitsandbytes' NF4 code table (functional.py get_4bit_type("nf4"), kernels.cu
// nf4_data), as a macro so CUDA can put the same literals in __constant__ memory.
#define TRAINSTREAM_NF4_CODE_VALUES                                                                \
  -1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f, -0.28444138169288635f, \
      -0.18477343022823334f, -0.09105003625154495f, 0.0f, 0.07958029955625534f,                    \
      0.16093020141124725f, 0.24611230194568634f, 0.33791524171829224f, 0.44070982933044434f,      \
      0.5626170039176941f, 0.7229568362236023f, 1.0f

// The decision thresholds of bitsandbytes' dQuantizeNF4 (its binary tree, listed in
// ascending order). A normalized value v gets code c = number of thresholds t with
// v > t: exactly the tree's answer, including ties (a value equal to a threshold
// takes the lower code) and NaN (all comparisons false: code 0), which is what an
// all-zero block produces in bitsandbytes (0 * (1/0)).
#define TRAINSTREAM_NF4_THRESHOLDS                                                                \
  -0.8480964004993439f, -0.6106329262256622f, -0.4599952697753906f, -0.33967943489551544f,        \
      -0.23460740596055984f, -0.13791173323988914f, -0.045525018125772476f, 0.03979014977812767f, \
      0.1202552504837513f, 0.2035212516784668f, 0.2920137718319893f, 0.3893125355243683f,         \
      0.5016634166240692f, 0.6427869200706482f, 0.8614784181118011f

// bitsandbytes' dQuantizeNF4 tree, verbatim in behaviour. `v` = x * (1.0f / absmax).
TS_QUANT_HD uint8_t Nf4Encode(float v) {
  if (v > 0.03979014977812767f) {
    if (v > 0.3893125355243683f) {
      if (v > 0.6427869200706482f) return v > 0.8614784181118011f ? 15 : 14;
      return v > 0.5016634166240692f ? 13 : 12;
    }
    if (v > 0.2035212516784668f) return v > 0.2920137718319893f ? 11 : 10;
    return v > 0.1202552504837513f ? 9 : 8;
  }
  if (v > -0.33967943489551544f) {
    if (v > -0.13791173323988914f) return v > -0.045525018125772476f ? 7 : 6;
    return v > -0.23460740596055984f ? 5 : 4;
  }
  if (v > -0.6106329262256622f) return v > -0.4599952697753906f ? 3 : 2;
  return v > -0.8480964004993439f ? 1 : 0;
}

// The same answer as Nf4Encode, as a count of thresholds below v: branch-free, so the
// CPU loops vectorize. (The tree is ordered, so "v > t" holds for exactly the first c
// thresholds; NaN passes none.) The C++ tests check the two agree.
TS_QUANT_HD uint8_t Nf4EncodeCount(float v) {
  const float t[15] = {TRAINSTREAM_NF4_THRESHOLDS};
  uint32_t c = 0;
  for (int k = 0; k < 15; ++k) c += static_cast<uint32_t>(v > t[k]);
  return static_cast<uint8_t>(c);
}

// ---- bit casts ---------------------------------------------------------------------
TS_QUANT_HD uint32_t FloatBits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  return u;
}
TS_QUANT_HD float BitsFloat(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}

// ---- e4m3 (OCP FP8 E4M3FN: bias 7, max 448, 0x7F/0xFF are NaN, no infinities) ------
// Round to nearest even, saturating: every finite |x| >= 448 becomes 448 (0x7E).
// The sign is the input's sign bit (so -0.0 and tiny negatives encode as 0x80).
// Written without branches (selects only) so the CPU loops vectorize and CUDA warps
// do not diverge; the C++ tests compare it with the exhaustive decode table.
TS_QUANT_HD uint8_t E4m3Encode(float x) {
  const uint32_t bits = FloatBits(x);
  const uint32_t sign = (bits >> 24) & 0x80u;
  const uint32_t abs_bits = bits & 0x7FFFFFFFu;
  // Normal e4m3 (|x| >= 2^-6): keep 3 of 23 mantissa bits, rounding to nearest even
  // on the raw bits; a carry out of the mantissa moves to the next exponent.
  const uint32_t rounded = abs_bits + 0x7FFFFu + ((abs_bits >> 20) & 1u);
  const uint32_t normal = (rounded >> 20) - (120u << 3);  // rebias exponent 127 -> 7
  // Subnormal e4m3 (|x| < 2^-6): |x| * 2^9 is exact, and rounding it to an integer
  // in [0, 8] gives the code (8 is the smallest normal, whose code is also 8). The
  // min() keeps the conversion defined for lanes that take another branch.
  float scaled = BitsFloat(abs_bits) * 512.0f;
  scaled = scaled < 16.0f ? scaled : 16.0f;
  const uint32_t subnormal = static_cast<uint32_t>(static_cast<int32_t>(rintf(scaled)));
  uint32_t code = abs_bits < 0x3C800000u ? subnormal : normal;
  code = abs_bits >= 0x43E00000u ? 0x7Eu : code;  // >= 448 (and inf): saturate
  code = abs_bits > 0x7F800000u ? 0x7Fu : code;   // NaN stays NaN
  return static_cast<uint8_t>(sign | code);
}

TS_QUANT_HD float E4m3Decode(uint8_t c) {
  const uint32_t sign = static_cast<uint32_t>(c & 0x80) << 24;
  const uint32_t exp = (c >> 3) & 0xF;
  const uint32_t man = c & 0x7;
  if ((c & 0x7F) == 0x7F) return BitsFloat(0x7FC00000u | sign);
  if (exp == 0) {
    // m * 2^-9, exact.
    return BitsFloat(FloatBits(static_cast<float>(man) * 0.001953125f) | sign);
  }
  return BitsFloat(sign | ((exp + 120u) << 23) | (man << 20));
}

// ---- e8m0 (OCP MX scale: 2^(code - 127), 0xFF is NaN) -------------------------------
// The fp8 format's block scale: the smallest power of two s with amax / s <= 448,
// i.e. s = 2^ceil(log2(amax / 448)), so no element of a block ever saturates.
// amax == 0 gives code 0 (2^-127) and all-zero codes. Results below 2^-127 clamp to
// 2^-127 (then tiny elements round to e4m3 subnormals or zero).
TS_QUANT_HD uint8_t E8m0ScaleForAmax(float amax, float ratio /* = amax / 448 */) {
  if (!(amax > 0.0f)) return 0;
  const uint32_t bits = FloatBits(ratio);
  int exp = static_cast<int>(bits >> 23) - 127;
  const uint32_t man = bits & 0x7FFFFFu;
  if ((bits >> 23) == 0) {
    // Subnormal ratio: below 2^-126, so the answer is 2^-127 or 2^-126.
    return man > 0x400000u ? 1 : 0;
  }
  if (man != 0) exp += 1;  // not a power of two: round the exponent up
  int code = exp + 127;
  if (code < 0) code = 0;
  if (code > 254) code = 254;
  return static_cast<uint8_t>(code);
}

TS_QUANT_HD float E8m0Decode(uint8_t c) {
  if (c == 0xFF) return BitsFloat(0x7FC00000u);
  if (c == 0) return BitsFloat(0x00400000u);  // 2^-127 is subnormal in fp32
  return BitsFloat(static_cast<uint32_t>(c) << 23);
}

// 1 / E8m0Decode(c), exact (a power of two) for the codes a finite amax produces.
TS_QUANT_HD float E8m0InverseDecode(uint8_t c) {
  // 2^(127 - code); code 0 -> 2^127, code 254 -> 2^-127 (subnormal).
  const int e = 127 - static_cast<int>(c);
  if (e >= -126) return BitsFloat(static_cast<uint32_t>(e + 127) << 23);
  return BitsFloat(0x00400000u);
}

// ---- e2m1 (OCP FP4: values 0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 is the sign) ---------
// Round to nearest even (ties go to the code with an even mantissa bit), saturating
// at 6. Comparisons only (the midpoints are exact in fp32); ">" marks a tie that goes
// down, ">=" one that goes up. NaN gives magnitude 0.
TS_QUANT_HD uint8_t E2m1Encode(float x) {
  const uint32_t sign = (FloatBits(x) >> 28) & 0x8u;
  const float a = fabsf(x);
  const uint32_t m = static_cast<uint32_t>(a > 0.25f) + static_cast<uint32_t>(a >= 0.75f) +
                     static_cast<uint32_t>(a > 1.25f) + static_cast<uint32_t>(a >= 1.75f) +
                     static_cast<uint32_t>(a > 2.5f) + static_cast<uint32_t>(a >= 3.5f) +
                     static_cast<uint32_t>(a > 5.0f);
  return static_cast<uint8_t>(sign | m);
}

#define TRAINSTREAM_E2M1_VALUES                                                                    \
  0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, \
      -6.0f

// ---- bf16 / fp16 conversions that agree with torch and CUDA ------------------------
// Round to nearest even; NaN stays NaN; subnormals are kept (no flush-to-zero, unlike
// AVX512_BF16's vcvtneps2bf16, which is why the CPU kernels do not use it).
TS_QUANT_HD uint16_t FloatToBf16Bits(float f) {
  const uint32_t u = FloatBits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
TS_QUANT_HD float Bf16BitsToFloat(uint16_t h) { return BitsFloat(static_cast<uint32_t>(h) << 16); }

// ---- layout ------------------------------------------------------------------------
// A tensor of `numel` elements is split into ceil(numel / block) blocks; the last is
// padded with zeros (quantized like any other value) to a whole block. Stored:
//   data:   padded_numel bytes (int8, fp8) or padded_numel / 2 bytes (nf4, nvfp4;
//           element 2j in the high nibble of byte j, element 2j+1 in the low one)
//   scales: one per block: fp32 absmax (int8, nf4), e8m0 byte (fp8), e4m3 byte (nvfp4)
//   tensor_scale: one fp32 (nvfp4 only)
struct QuantLayout {
  int64_t numel = 0;
  int64_t block_size = 0;
  int64_t num_blocks = 0;
  int64_t padded_numel = 0;
  int64_t data_bytes = 0;
  int64_t scale_bytes_each = 0;  // 4 (fp32) or 1 (e8m0 / e4m3)
  int64_t padding() const { return padded_numel - numel; }
  int64_t scale_bytes() const { return num_blocks * scale_bytes_each; }
};

// The block size the format really uses: fp8 and nvfp4 ignore `requested`.
TS_QUANT_HD int64_t EffectiveBlockSize(QuantFormat fmt, int64_t requested) {
  switch (fmt) {
    case QuantFormat::kFp8:
      return kFp8Block;
    case QuantFormat::kNvfp4:
      return kNvfp4Block;
    default:
      return requested;
  }
}

TS_QUANT_HD QuantLayout MakeQuantLayout(QuantFormat fmt, int64_t numel, int64_t requested_block) {
  QuantLayout l;
  l.numel = numel;
  l.block_size = EffectiveBlockSize(fmt, requested_block);
  l.num_blocks = (numel + l.block_size - 1) / l.block_size;
  l.padded_numel = l.num_blocks * l.block_size;
  const bool nibbles = fmt == QuantFormat::kNf4 || fmt == QuantFormat::kNvfp4;
  l.data_bytes = nibbles ? l.padded_numel / 2 : l.padded_numel;
  l.scale_bytes_each = (fmt == QuantFormat::kInt8 || fmt == QuantFormat::kNf4) ? 4 : 1;
  return l;
}

}  // namespace trainstream::kernels
