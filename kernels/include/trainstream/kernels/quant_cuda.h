// CUDA quantize / dequantize for frozen weights: the client side of quant.h. Same
// formats, same bytes as the CPU kernels (Note [Identical bytes on CPU and CUDA] in
// quant_format.h). Launchers take raw device pointers and a stream, enqueue work and
// return without synchronizing; the caller owns every buffer.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "trainstream/kernels/quant.h"
#include "trainstream/kernels/quant_format.h"

namespace trainstream::kernels {

// Quantizes layout.numel elements of `src` (device memory, contiguous, finite).
// `out` holds device pointers sized as in quant.h; for nvfp4, out.tensor_scale must
// be a device float and `amax_workspace` a device uint32 (both written here); other
// formats ignore both. Returns the first launch error, or cudaSuccess;
// cudaErrorInvalidValue, launching nothing, when !QuantTakesDType(src_type).
cudaError_t QuantizeCuda(QuantFormat fmt, const QuantLayout& layout, DType src_type,
                         const void* src, const QuantBuffers& out, uint32_t* amax_workspace,
                         cudaStream_t stream);

// Writes layout.numel elements of `dst_type` to `dst` (device). `tensor_scale` is a
// device pointer to nvfp4's fp32 tensor scale (ignored by the other formats).
// cudaErrorInvalidValue, launching nothing, when !QuantTakesDType(dst_type).
cudaError_t DequantizeCuda(QuantFormat fmt, const QuantLayout& layout, const uint8_t* data,
                           const void* scales, const float* tensor_scale, DType dst_type, void* dst,
                           cudaStream_t stream);

// Activations for FP8 matmuls with row-wise scales (torch._scaled_mm on Hopper): for
// each of `rows` rows of `cols` (> 0) elements of `src` (device, row-major,
// contiguous; any DType: activations may be fp16 too), in one kernel,
//   scales[r] = max(amax_r * fp32(1/448), 1e-30f)       (fp32, correctly rounded)
//   q[r * cols + k] = E4m3Encode(src[r][k] / scales[r])  (fp32 division, RNE)
// q: rows * cols bytes (e4m3fn, row-major); scales: rows floats. Bit for bit the
// eager torch expression (x.abs().amax(1).float() * (1 / 448)).clamp_min(1e-30) and
// (x.float() / scale).to(torch.float8_e4m3fn) for finite inputs (on CUDA torch also
// evaluates `/ 448.0` as that product).
cudaError_t QuantizeRowsE4m3Cuda(DType src_type, const void* src, int64_t rows, int64_t cols,
                                 uint8_t* q, float* scales, cudaStream_t stream);

}  // namespace trainstream::kernels
