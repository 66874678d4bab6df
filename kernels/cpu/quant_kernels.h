// The per-instruction-set entry points of the CPU quantization kernels (bodies in
// quant_kernels_inl.h). quant_cpu.cc picks one at run time and splits the work.
#pragma once

#include <cstdint>

#include "trainstream/kernels/quant.h"

namespace trainstream::kernels::quant_internal {

#define TS_QUANT_DECLARE_ISA(ns)                                                            \
  namespace ns {                                                                            \
  float AbsMaxRange(DType type, const void* src, int64_t begin, int64_t end);               \
  void QuantizeBlocks(QuantFormat fmt, const QuantLayout& l, DType type, const void* src,   \
                      const QuantBuffers& out, float tensor_scale, int64_t b0, int64_t b1); \
  void DequantizeBlocks(QuantFormat fmt, const QuantLayout& l, const QuantConstBuffers& in, \
                        DType type, void* dst, int64_t b0, int64_t b1);                     \
  }

TS_QUANT_DECLARE_ISA(scalar)
TS_QUANT_DECLARE_ISA(avx2)
TS_QUANT_DECLARE_ISA(avx512)
#undef TS_QUANT_DECLARE_ISA

}  // namespace trainstream::kernels::quant_internal
