// CUDA quantize for int8, nf4, fp8, nvfp4, used when a model is quantized on the GPU.
// One thread per quantization block, running the same per-block steps as the CPU
// kernels (quant_kernels_inl.h) with the codecs of quant_format.h; divisions and
// products are spelled __fdiv_rn/__fmul_rn so nvcc cannot contract or approximate
// them (Note [Identical bytes on CPU and CUDA]). Quantizing is done once per weight,
// so clarity and byte-exactness come before the last bit of bandwidth here.
#include "quant_cuda_check.cuh"
#include "trainstream/kernels/quant_cuda.h"

namespace trainstream::kernels {
namespace {

constexpr int kThreads = 128;

template <typename SrcT>
__device__ __forceinline__ float LoadAsFloat(const SrcT* p, int64_t i);
template <>
__device__ __forceinline__ float LoadAsFloat<float>(const float* p, int64_t i) {
  return p[i];
}
template <>
__device__ __forceinline__ float LoadAsFloat<uint16_t>(const uint16_t* p, int64_t i) {
  return Bf16BitsToFloat(p[i]);
}

// Element i of block b, zero past the end of the tensor (the padding).
template <typename SrcT>
__device__ __forceinline__ float Element(const SrcT* src, int64_t start, int64_t i, int64_t numel) {
  return start + i < numel ? LoadAsFloat(src, start + i) : 0.0f;
}

template <typename SrcT>
__device__ float BlockAbsMax(const SrcT* src, int64_t start, int64_t n, int64_t numel) {
  uint32_t m = 0;  // |x| as bits: same order as the floats, same result as the CPU
  for (int64_t i = 0; i < n; ++i)
    m = max(m, FloatBits(Element(src, start, i, numel)) & 0x7FFFFFFFu);
  return BitsFloat(m);
}

template <QuantFormat F, typename SrcT>
__global__ void __launch_bounds__(kThreads)
    QuantizeBlocksKernel(const SrcT* __restrict__ src, int64_t numel, int64_t block,
                         int64_t num_blocks, uint8_t* __restrict__ data, void* scales,
                         const float* __restrict__ tensor_scale) {
  for (int64_t b = blockIdx.x * int64_t{kThreads} + threadIdx.x; b < num_blocks;
       b += int64_t{gridDim.x} * kThreads) {
    const int64_t start = b * block;
    const float absmax = BlockAbsMax(src, start, block, numel);
    if constexpr (F == QuantFormat::kInt8) {
      const float inv = absmax > 0.0f ? __fdiv_rn(127.0f, absmax) : 0.0f;
      for (int64_t i = 0; i < block; ++i) {
        float r = rintf(__fmul_rn(Element(src, start, i, numel), inv));
        r = r < 127.0f ? r : 127.0f;
        r = r > -127.0f ? r : -127.0f;
        data[start + i] = static_cast<uint8_t>(static_cast<int8_t>(static_cast<int32_t>(r)));
      }
      static_cast<float*>(scales)[b] = absmax;
    } else if constexpr (F == QuantFormat::kNf4) {
      const float inv = __fdiv_rn(1.0f, absmax);  // bitsandbytes: 1/0 = inf -> NaN -> code 0
      for (int64_t j = 0; j < block / 2; ++j) {
        const uint8_t hi = Nf4Encode(__fmul_rn(Element(src, start, 2 * j, numel), inv));
        const uint8_t lo = Nf4Encode(__fmul_rn(Element(src, start, 2 * j + 1, numel), inv));
        data[start / 2 + j] = static_cast<uint8_t>((hi << 4) | lo);
      }
      static_cast<float*>(scales)[b] = absmax;
    } else if constexpr (F == QuantFormat::kFp8) {
      const uint8_t scale = E8m0ScaleForAmax(absmax, __fdiv_rn(absmax, kE4m3Max));
      const float inv = E8m0InverseDecode(scale);
      for (int64_t i = 0; i < kFp8Block; ++i) {
        data[start + i] = E4m3Encode(__fmul_rn(Element(src, start, i, numel), inv));
      }
      static_cast<uint8_t*>(scales)[b] = scale;
    } else {  // nvfp4
      const float g = *tensor_scale;
      uint8_t scale = 0;
      float eff = 0.0f;
      if (g > 0.0f && absmax > 0.0f) {
        scale = E4m3Encode(__fdiv_rn(__fdiv_rn(absmax, kE2m1Max), g));
        eff = __fmul_rn(E4m3Decode(scale), g);
      }
      for (int64_t j = 0; j < kNvfp4Block / 2; ++j) {
        uint8_t hi = 0, lo = 0;
        if (eff > 0.0f) {
          hi = E2m1Encode(__fdiv_rn(Element(src, start, 2 * j, numel), eff));
          lo = E2m1Encode(__fdiv_rn(Element(src, start, 2 * j + 1, numel), eff));
        }
        data[start / 2 + j] = static_cast<uint8_t>((hi << 4) | lo);
      }
      static_cast<uint8_t*>(scales)[b] = scale;
    }
  }
}

template <typename SrcT>
__global__ void AbsMaxKernel(const SrcT* __restrict__ src, int64_t numel, uint32_t* amax_bits) {
  uint32_t m = 0;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < numel;
       i += int64_t{gridDim.x} * blockDim.x) {
    m = max(m, FloatBits(LoadAsFloat(src, i)) & 0x7FFFFFFFu);
  }
  // Warp reduce, then one atomic per warp: max is order-independent, so exact.
  for (int off = 16; off > 0; off >>= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, off));
  if ((threadIdx.x & 31) == 0) atomicMax(amax_bits, m);
}

__global__ void TensorScaleKernel(const uint32_t* amax_bits, float* tensor_scale) {
  *tensor_scale = __fdiv_rn(BitsFloat(*amax_bits), kE2m1Max * kE4m3Max);
}

int GridFor(int64_t items, int threads) {
  const int64_t blocks = (items + threads - 1) / threads;
  return static_cast<int>(blocks < 132 * 32 ? (blocks > 0 ? blocks : 1) : 132 * 32);
}

template <typename SrcT>
cudaError_t Quantize(QuantFormat fmt, const QuantLayout& l, const SrcT* src,
                     const QuantBuffers& out, uint32_t* amax_workspace, cudaStream_t stream) {
  const int grid = GridFor(l.num_blocks, kThreads);
  switch (fmt) {
    case QuantFormat::kInt8:
      QuantizeBlocksKernel<QuantFormat::kInt8><<<grid, kThreads, 0, stream>>>(
          src, l.numel, l.block_size, l.num_blocks, out.data, out.scales, nullptr);
      TS_CUDA_LAUNCH_CHECK();
      break;
    case QuantFormat::kNf4:
      QuantizeBlocksKernel<QuantFormat::kNf4><<<grid, kThreads, 0, stream>>>(
          src, l.numel, l.block_size, l.num_blocks, out.data, out.scales, nullptr);
      TS_CUDA_LAUNCH_CHECK();
      break;
    case QuantFormat::kFp8:
      QuantizeBlocksKernel<QuantFormat::kFp8><<<grid, kThreads, 0, stream>>>(
          src, l.numel, l.block_size, l.num_blocks, out.data, out.scales, nullptr);
      TS_CUDA_LAUNCH_CHECK();
      break;
    case QuantFormat::kNvfp4:
      TS_CUDA_CHECK(cudaMemsetAsync(amax_workspace, 0, sizeof(uint32_t), stream));
      AbsMaxKernel<<<GridFor(l.numel, 256), 256, 0, stream>>>(src, l.numel, amax_workspace);
      TS_CUDA_LAUNCH_CHECK();
      TensorScaleKernel<<<1, 1, 0, stream>>>(amax_workspace, out.tensor_scale);
      TS_CUDA_LAUNCH_CHECK();
      QuantizeBlocksKernel<QuantFormat::kNvfp4><<<grid, kThreads, 0, stream>>>(
          src, l.numel, l.block_size, l.num_blocks, out.data, out.scales, out.tensor_scale);
      TS_CUDA_LAUNCH_CHECK();
      break;
  }
  return cudaSuccess;
}

}  // namespace

cudaError_t QuantizeCuda(QuantFormat fmt, const QuantLayout& layout, DType src_type,
                         const void* src, const QuantBuffers& out, uint32_t* amax_workspace,
                         cudaStream_t stream) {
  if (!QuantTakesDType(src_type)) return cudaErrorInvalidValue;
  if (layout.num_blocks == 0) {
    if (fmt == QuantFormat::kNvfp4) {
      TS_CUDA_CHECK(cudaMemsetAsync(out.tensor_scale, 0, sizeof(float), stream));
    }
    return cudaSuccess;
  }
  if (src_type == DType::kFloat32) {
    return Quantize(fmt, layout, static_cast<const float*>(src), out, amax_workspace, stream);
  }
  return Quantize(fmt, layout, static_cast<const uint16_t*>(src), out, amax_workspace, stream);
}

}  // namespace trainstream::kernels
