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
// formats ignore both. Returns the first launch error, or cudaSuccess.
cudaError_t QuantizeCuda(QuantFormat fmt, const QuantLayout& layout, QuantElemType src_type,
                         const void* src, const QuantBuffers& out, uint32_t* amax_workspace,
                         cudaStream_t stream);

// Writes layout.numel elements of `dst_type` to `dst` (device). `tensor_scale` is a
// device pointer to nvfp4's fp32 tensor scale (ignored by the other formats).
cudaError_t DequantizeCuda(QuantFormat fmt, const QuantLayout& layout, const uint8_t* data,
                           const void* scales, const float* tensor_scale,
                           QuantElemType dst_type, void* dst, cudaStream_t stream);

}  // namespace trainstream::kernels
