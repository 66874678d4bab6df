// CPU quantize / dequantize for frozen weights (int8, nf4, fp8, nvfp4). The daemon's
// base loader calls these while it reads a checkpoint; the torch extension calls them
// for CPU tensors. Formats and byte layouts: quant_format.h and docs/quantization.md.
// The CUDA launchers (quant_cuda.h) produce identical bytes.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "trainstream/kernels/cpu_features.h"
#include "trainstream/kernels/quant_format.h"
#include "trainstream/wire/dtype.h"

namespace trainstream::kernels {

// Element types are the wire's DType, as everywhere (Note [DType numbers are the
// wire's]). The kernels here read (quantize) and write (dequantize) kFloat32 and
// kBFloat16 only: a caller converts fp16 to fp32 first (exact, so the bytes do not
// change) and checks QuantTakesDType before it calls; any other value is a
// precondition broken. The CUDA launchers (quant_cuda.h) refuse it with
// cudaErrorInvalidValue.
using wire::DType;
constexpr bool QuantTakesDType(DType dtype) {
  return dtype == DType::kFloat32 || dtype == DType::kBFloat16;
}

// "int8", "nf4", "fp8", "nvfp4". Returns false for anything else.
bool ParseQuantFormat(std::string_view name, QuantFormat* out);
const char* QuantFormatName(QuantFormat fmt);

// Empty when (fmt, block_size) is valid; otherwise a message naming the problem and
// what is accepted. int8 and nf4 accept any even block_size >= 2; fp8 and nvfp4 use
// their fixed blocks (32, 16) and ignore block_size.
std::string QuantArgsError(QuantFormat fmt, int64_t block_size);

struct QuantCpuOptions {
  Isa isa = BestIsa();  // kScalar is the reference the vectorized paths must match
  int num_threads = 0;  // 0: one per hardware thread, fewer for small tensors
};

// Where a quantized tensor lives. The caller owns all three buffers, sized by
// MakeQuantLayout: data_bytes, scale_bytes(), and one float for nvfp4.
struct QuantBuffers {
  uint8_t* data = nullptr;
  void* scales = nullptr;         // float[num_blocks] or uint8_t[num_blocks]
  float* tensor_scale = nullptr;  // nvfp4 only (may be null otherwise)
};

struct QuantConstBuffers {
  const uint8_t* data = nullptr;
  const void* scales = nullptr;
  float tensor_scale = 0.0f;  // nvfp4 only
};

// Quantizes layout.numel elements of `src` (contiguous, finite: the caller checks;
// a NaN or infinity gives defined but meaningless bytes). Padding elements are zeros.
// Preconditions: QuantArgsError(fmt, layout.block_size) is empty and `layout` came
// from MakeQuantLayout(fmt, ...).
void QuantizeCpu(QuantFormat fmt, const QuantLayout& layout, DType src_type, const void* src,
                 const QuantBuffers& out, const QuantCpuOptions& opts = {});

// The piecewise form of QuantizeCpu, for a reader that holds one piece of a tensor
// at a time (the daemon's base loader). Quantizes blocks [first_block, end_block)
// of the tensor `layout` describes. `src` holds just those blocks' elements: element
// first_block * layout.block_size of the tensor is src[0], and the piece ends at
// min(layout.numel, end_block * layout.block_size) (the last block's padding is
// zeros, as in QuantizeCpu). `out` is the whole tensor's buffers; only the codes and
// scales of those blocks are written, and out.tensor_scale never is. `tensor_scale`
// is nvfp4's per-tensor scale, Nvfp4TensorScale(AbsMaxCpu of the whole tensor);
// other formats ignore it. Blocks are independent, so pieces quantized separately,
// in any order and on any threads, give exactly QuantizeCpu's bytes.
// Preconditions: as QuantizeCpu, and 0 <= first_block <= end_block <= num_blocks.
void QuantizeBlockRangeCpu(QuantFormat fmt, const QuantLayout& layout, DType src_type,
                           const void* src, int64_t first_block, int64_t end_block,
                           const QuantBuffers& out, float tensor_scale,
                           const QuantCpuOptions& opts = {});

// The largest |x| of n elements of `src` (finite; +0 for n == 0). The maximum of the
// pieces' AbsMaxCpu is the whole tensor's.
float AbsMaxCpu(DType src_type, const void* src, int64_t n, const QuantCpuOptions& opts = {});

// nvfp4's per-tensor scale for a tensor whose largest |x| is `amax`: amax / (6 * 448),
// the dequant multiplier of a block scale. Zero for an all-zero tensor.
float Nvfp4TensorScale(float amax);

// Writes layout.numel elements (padding dropped) of type `dst_type` to `dst`.
void DequantizeCpu(QuantFormat fmt, const QuantLayout& layout, const QuantConstBuffers& in,
                   DType dst_type, void* dst, const QuantCpuOptions& opts = {});

}  // namespace trainstream::kernels
