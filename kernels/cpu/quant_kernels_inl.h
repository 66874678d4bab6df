// The CPU quantization kernels' bodies, compiled three times: quant_scalar.cc (the
// reference, auto-vectorization off), quant_avx2.cc and quant_avx512.cc (the same
// loops vectorized by the compiler for that instruction set). Each includes this file
// inside its own namespace, TS_QUANT_ISA_NS, so the three copies never merge at link
// time. The loops are written to vectorize: fixed-shape inner loops, selects instead
// of branches, integer max for absmax (a float max reduction only vectorizes under
// fast-math, which Note [Identical bytes on CPU and CUDA] rules out).
//
// Every value is produced by the functions of quant_format.h, in the same order as
// the CUDA kernels, so the bytes do not depend on the path.
#ifndef TS_QUANT_ISA_NS
#error "define TS_QUANT_ISA_NS before including quant_kernels_inl.h"
#endif

#include <algorithm>
#include <cstdint>
#include <vector>

#include "trainstream/kernels/quant.h"
#include "trainstream/kernels/quant_format.h"

namespace trainstream::kernels::quant_internal::TS_QUANT_ISA_NS {
namespace {

constexpr float kNf4Code[16] = {TRAINSTREAM_NF4_CODE_VALUES};
constexpr float kE2m1Value[16] = {TRAINSTREAM_E2M1_VALUES};

struct E4m3Table {
  float v[256];
  E4m3Table() {
    for (int c = 0; c < 256; ++c) v[c] = E4m3Decode(static_cast<uint8_t>(c));
  }
};
const E4m3Table& E4m3Values() {
  static const E4m3Table table;
  return table;
}

// |x| as bits: for non-negative finite floats the unsigned order is the float order.
float AbsMaxOf(const float* x, int64_t n) {
  uint32_t m = 0;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, FloatBits(x[i]) & 0x7FFFFFFFu);
  return BitsFloat(m);
}

template <typename SrcT>
float ToFloat(SrcT v);
template <>
float ToFloat<float>(float v) {
  return v;
}
template <>
float ToFloat<uint16_t>(uint16_t v) {
  return Bf16BitsToFloat(v);
}

// Copies one block to `buf` as fp32, zero-filling the padding.
template <typename SrcT>
void LoadBlock(const SrcT* src, int64_t start, int64_t valid, int64_t block, float* buf) {
  for (int64_t i = 0; i < valid; ++i) buf[i] = ToFloat(src[start + i]);
  for (int64_t i = valid; i < block; ++i) buf[i] = 0.0f;
}

void PackNibbles(const uint8_t* codes, int64_t n, uint8_t* out) {
  // Element 2j in the high nibble (bitsandbytes' order).
  for (int64_t j = 0; j < n / 2; ++j) {
    out[j] = static_cast<uint8_t>((codes[2 * j] << 4) | codes[2 * j + 1]);
  }
}

void QuantizeInt8Block(const float* x, int64_t n, int8_t* q, float* absmax_out) {
  const float absmax = AbsMaxOf(x, n);
  const float inv = absmax > 0.0f ? 127.0f / absmax : 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    float r = rintf(x[i] * inv);
    r = r < 127.0f ? r : 127.0f;
    r = r > -127.0f ? r : -127.0f;
    q[i] = static_cast<int8_t>(static_cast<int32_t>(r));
  }
  *absmax_out = absmax;
}

void QuantizeNf4Block(const float* x, int64_t n, uint8_t* codes, uint8_t* out, float* absmax_out) {
  const float absmax = AbsMaxOf(x, n);
  // bitsandbytes multiplies by the reciprocal (an all-zero block: 0 * inf = NaN,
  // which encodes as code 0); we do the same to match its bytes.
  const float inv = 1.0f / absmax;
  for (int64_t i = 0; i < n; ++i) codes[i] = Nf4EncodeCount(x[i] * inv);
  PackNibbles(codes, n, out);
  *absmax_out = absmax;
}

void QuantizeFp8Block(const float* x, uint8_t* q, uint8_t* scale_out) {
  const float absmax = AbsMaxOf(x, kFp8Block);
  const uint8_t scale = E8m0ScaleForAmax(absmax, absmax / kE4m3Max);
  const float inv = E8m0InverseDecode(scale);  // a power of two: x * inv is exact
  for (int64_t i = 0; i < kFp8Block; ++i) q[i] = E4m3Encode(x[i] * inv);
  *scale_out = scale;
}

void QuantizeNvfp4Block(const float* x, float tensor_scale, uint8_t* codes, uint8_t* out,
                        uint8_t* scale_out) {
  const float absmax = AbsMaxOf(x, kNvfp4Block);
  uint8_t scale = 0;
  float eff = 0.0f;
  if (tensor_scale > 0.0f && absmax > 0.0f) {
    scale = E4m3Encode((absmax / kE2m1Max) / tensor_scale);
    eff = E4m3Decode(scale) * tensor_scale;
  }
  if (eff > 0.0f) {
    for (int64_t i = 0; i < kNvfp4Block; ++i) codes[i] = E2m1Encode(x[i] / eff);
  } else {
    for (int64_t i = 0; i < kNvfp4Block; ++i) codes[i] = 0;
  }
  PackNibbles(codes, kNvfp4Block, out);
  *scale_out = scale;
}

template <typename SrcT>
void QuantizeBlocksT(QuantFormat fmt, const QuantLayout& l, const SrcT* src,
                     const QuantBuffers& out, float tensor_scale, int64_t b0, int64_t b1) {
  const int64_t block = l.block_size;
  std::vector<float> buf(block);
  std::vector<uint8_t> codes(block);
  auto* fscales = static_cast<float*>(out.scales);
  auto* bscales = static_cast<uint8_t*>(out.scales);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t start = b * block;
    LoadBlock(src, start, std::min(block, l.numel - start), block, buf.data());
    switch (fmt) {
      case QuantFormat::kInt8:
        QuantizeInt8Block(buf.data(), block, reinterpret_cast<int8_t*>(out.data + start),
                          &fscales[b]);
        break;
      case QuantFormat::kNf4:
        QuantizeNf4Block(buf.data(), block, codes.data(), out.data + start / 2, &fscales[b]);
        break;
      case QuantFormat::kFp8:
        QuantizeFp8Block(buf.data(), out.data + start, &bscales[b]);
        break;
      case QuantFormat::kNvfp4:
        QuantizeNvfp4Block(buf.data(), tensor_scale, codes.data(), out.data + start / 2,
                           &bscales[b]);
        break;
    }
  }
}

// Dequantizes block b to fp32 in `y` (block_size values, padding included).
void DequantizeBlock(QuantFormat fmt, const QuantLayout& l, const QuantConstBuffers& in, int64_t b,
                     float* y) {
  const int64_t block = l.block_size;
  const int64_t start = b * block;
  const auto* fscales = static_cast<const float*>(in.scales);
  const auto* bscales = static_cast<const uint8_t*>(in.scales);
  switch (fmt) {
    case QuantFormat::kInt8: {
      const float d = fscales[b] / 127.0f;
      const auto* q = reinterpret_cast<const int8_t*>(in.data + start);
      for (int64_t i = 0; i < block; ++i) y[i] = static_cast<float>(q[i]) * d;
      break;
    }
    case QuantFormat::kNf4: {
      const float absmax = fscales[b];
      const uint8_t* p = in.data + start / 2;
      for (int64_t j = 0; j < block / 2; ++j) {
        y[2 * j] = kNf4Code[p[j] >> 4] * absmax;
        y[2 * j + 1] = kNf4Code[p[j] & 0xF] * absmax;
      }
      break;
    }
    case QuantFormat::kFp8: {
      const float s = E8m0Decode(bscales[b]);
      const float* table = E4m3Values().v;
      const uint8_t* q = in.data + start;
      for (int64_t i = 0; i < kFp8Block; ++i) y[i] = table[q[i]] * s;
      break;
    }
    case QuantFormat::kNvfp4: {
      const float eff = E4m3Decode(bscales[b]) * in.tensor_scale;
      const uint8_t* p = in.data + start / 2;
      for (int64_t j = 0; j < kNvfp4Block / 2; ++j) {
        y[2 * j] = kE2m1Value[p[j] >> 4] * eff;
        y[2 * j + 1] = kE2m1Value[p[j] & 0xF] * eff;
      }
      break;
    }
  }
}

}  // namespace

float AbsMaxRange(DType type, const void* src, int64_t begin, int64_t end) {
  uint32_t m = 0;
  if (type == DType::kFloat32) {
    const auto* p = static_cast<const float*>(src);
    for (int64_t i = begin; i < end; ++i) m = std::max(m, FloatBits(p[i]) & 0x7FFFFFFFu);
  } else {
    const auto* p = static_cast<const uint16_t*>(src);
    for (int64_t i = begin; i < end; ++i) {
      m = std::max(m, (static_cast<uint32_t>(p[i]) << 16) & 0x7FFFFFFFu);
    }
  }
  return BitsFloat(m);
}

void QuantizeBlocks(QuantFormat fmt, const QuantLayout& l, DType type, const void* src,
                    const QuantBuffers& out, float tensor_scale, int64_t b0, int64_t b1) {
  if (type == DType::kFloat32) {
    QuantizeBlocksT(fmt, l, static_cast<const float*>(src), out, tensor_scale, b0, b1);
  } else {
    QuantizeBlocksT(fmt, l, static_cast<const uint16_t*>(src), out, tensor_scale, b0, b1);
  }
}

void DequantizeBlocks(QuantFormat fmt, const QuantLayout& l, const QuantConstBuffers& in,
                      DType type, void* dst, int64_t b0, int64_t b1) {
  std::vector<float> y(l.block_size);
  for (int64_t b = b0; b < b1; ++b) {
    DequantizeBlock(fmt, l, in, b, y.data());
    const int64_t start = b * l.block_size;
    const int64_t valid = std::min(l.block_size, l.numel - start);
    if (type == DType::kFloat32) {
      float* o = static_cast<float*>(dst) + start;
      for (int64_t i = 0; i < valid; ++i) o[i] = y[i];
    } else {
      uint16_t* o = static_cast<uint16_t*>(dst) + start;
      for (int64_t i = 0; i < valid; ++i) o[i] = FloatToBf16Bits(y[i]);
    }
  }
}

}  // namespace trainstream::kernels::quant_internal::TS_QUANT_ISA_NS
