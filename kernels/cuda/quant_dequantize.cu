// CUDA dequantize for int8, nf4, fp8, nvfp4: the client's hot path (a frozen weight
// is dequantized to bf16 right before its matmul). Memory bound, so each thread
// handles one 16-byte load of codes (16 int8/fp8 or 32 nf4/nvfp4 elements) and
// writes its outputs with 16-byte stores. Code tables live in shared memory (a
// constant-memory lookup with different indices per lane would serialize).
// Products use __fmul_rn so the values equal the CPU kernels' (quant_format.h).
//
// nf4 and nvfp4 to bf16 (the common case, and the one where the output is 3.6x the
// input) take DequantizeNibbleBf16 instead: there the output stores dominate, so the
// kernel is organised around them. Each thread decodes a 4-byte code word (8
// elements) into one 16-byte store, and a warp's loads (128 contiguous bytes) and
// stores (512 contiguous bytes) are both fully coalesced; each thread keeps
// kNibbleUnroll words (and their scales) in flight; registers stay at 32 (packed
// bf16x2, no float arrays), so an SM runs 2048 threads; the grid is one wave sized
// from the SM count and the occupancy, each block taking an equal contiguous range.
// The values are the same products, rounded the same way, as the generic kernels.
#include <cuda_bf16.h>

#include <type_traits>

#include "quant_cuda_check.cuh"
#include "trainstream/kernels/quant_cuda.h"

namespace trainstream::kernels {
namespace {

constexpr int kThreads = 256;

__constant__ float kNf4CodeDev[16] = {TRAINSTREAM_NF4_CODE_VALUES};
__constant__ float kE2m1ValueDev[16] = {TRAINSTREAM_E2M1_VALUES};

template <typename OutT>
__device__ __forceinline__ OutT FromFloat(float v);
template <>
__device__ __forceinline__ float FromFloat<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);  // RNE, subnormals kept: same as FloatToBf16Bits
}

// Stores n (16 or 32) values starting at element e0, vectorized when the whole chunk
// is inside the tensor (the launcher checked alignment), element by element otherwise.
template <typename OutT, int N>
__device__ __forceinline__ void StoreChunk(const float (&y)[N], OutT* out, int64_t e0,
                                           int64_t numel) {
  if (e0 + N <= numel) {
    OutT v[N];
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = FromFloat<OutT>(y[i]);
    constexpr int kVecs = N * sizeof(OutT) / 16;
    const uint4* src = reinterpret_cast<const uint4*>(v);
    uint4* dst = reinterpret_cast<uint4*>(out + e0);
#pragma unroll
    for (int i = 0; i < kVecs; ++i) dst[i] = src[i];
  } else {
    for (int i = 0; i < N && e0 + i < numel; ++i) out[e0 + i] = FromFloat<OutT>(y[i]);
  }
}

// One thread per 16 bytes of codes. Requires: data 16-byte aligned, data_bytes a
// multiple of 16 (else the last chunk goes through DequantizeGeneric), out 16-byte
// aligned, and for int8/nf4 a block size that is a multiple of the chunk's elements.
template <QuantFormat F, typename OutT>
__global__ void __launch_bounds__(kThreads)
    DequantizeVec(const uint8_t* __restrict__ data, const void* __restrict__ scales,
                  const float* __restrict__ tensor_scale, int64_t numel, int64_t block,
                  int64_t num_chunks, OutT* __restrict__ out) {
  __shared__ float table[256];
  if constexpr (F == QuantFormat::kNf4) {
    if (threadIdx.x < 16) table[threadIdx.x] = kNf4CodeDev[threadIdx.x];
  } else if constexpr (F == QuantFormat::kNvfp4) {
    if (threadIdx.x < 16) table[threadIdx.x] = kE2m1ValueDev[threadIdx.x];
  } else if constexpr (F == QuantFormat::kFp8) {
    table[threadIdx.x] = E4m3Decode(static_cast<uint8_t>(threadIdx.x));  // kThreads == 256
  }
  __syncthreads();
  const float* fscales = static_cast<const float*>(scales);
  const uint8_t* bscales = static_cast<const uint8_t*>(scales);
  const float g = F == QuantFormat::kNvfp4 ? *tensor_scale : 0.0f;
  for (int64_t c = blockIdx.x * int64_t{kThreads} + threadIdx.x; c < num_chunks;
       c += int64_t{gridDim.x} * kThreads) {
    const uint4 raw = reinterpret_cast<const uint4*>(data)[c];
    uint8_t b[16];
    *reinterpret_cast<uint4*>(b) = raw;
    if constexpr (F == QuantFormat::kInt8) {
      const int64_t e0 = c * 16;
      const float d = __fdiv_rn(fscales[e0 / block], 127.0f);
      float y[16];
#pragma unroll
      for (int i = 0; i < 16; ++i)
        y[i] = __fmul_rn(static_cast<float>(static_cast<int8_t>(b[i])), d);
      StoreChunk(y, out, e0, numel);
    } else if constexpr (F == QuantFormat::kFp8) {
      const int64_t e0 = c * 16;
      const float s = E8m0Decode(bscales[e0 / kFp8Block]);
      float y[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) y[i] = __fmul_rn(table[b[i]], s);
      StoreChunk(y, out, e0, numel);
    } else if constexpr (F == QuantFormat::kNf4) {
      const int64_t e0 = c * 32;
      const float absmax = fscales[e0 / block];
      float y[32];
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        y[2 * j] = __fmul_rn(table[b[j] >> 4], absmax);
        y[2 * j + 1] = __fmul_rn(table[b[j] & 0xF], absmax);
      }
      StoreChunk(y, out, e0, numel);
    } else {  // nvfp4: 32 elements = two blocks of 16
      const int64_t e0 = c * 32;
      const float eff0 = __fmul_rn(E4m3Decode(bscales[2 * c]), g);
      const float eff1 = __fmul_rn(E4m3Decode(bscales[2 * c + 1]), g);
      float y[32];
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const float eff = j < 8 ? eff0 : eff1;
        y[2 * j] = __fmul_rn(table[b[j] >> 4], eff);
        y[2 * j + 1] = __fmul_rn(table[b[j] & 0xF], eff);
      }
      StoreChunk(y, out, e0, numel);
    }
  }
}

// ---- nf4 / nvfp4 to bf16 ------------------------------------------------------------
constexpr int kNibbleThreads = 256;
constexpr int kNibbleUnroll = 4;     // code words (8 elements each) per thread per step
constexpr int kNibbleMinBlocks = 8;  // 2048 threads per SM: <= 32 registers, no spills
constexpr int64_t kNibbleStepWords = int64_t{kNibbleThreads} * kNibbleUnroll;

__device__ __forceinline__ uint32_t LoadWordNc(const uint32_t* p) {
  uint32_t v;
  asm("ld.global.nc.L1::no_allocate.b32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

// Two floats to a packed bf16x2 (lo = first element in memory), RNE, subnormals kept:
// the same bits as two __float2bfloat16_rn.
__device__ __forceinline__ uint32_t PackBf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Word w holds elements 8w..8w+7; byte j of the word (little-endian) holds elements
// 8w+2j (high nibble) and 8w+2j+1 (low nibble). `scale` multiplies every value.
__device__ __forceinline__ uint4 DecodeNibbleWord(uint32_t w, const float* table, float scale) {
  uint32_t o[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t byte = (w >> (8 * j)) & 0xFFu;
    const float hi = __fmul_rn(table[byte >> 4], scale);
    const float lo = __fmul_rn(table[byte & 0xFu], scale);
    o[j] = PackBf16x2(hi, lo);  // element 2j first
  }
  return make_uint4(o[0], o[1], o[2], o[3]);
}

// Block b decodes the words [b * words_per_block, (b + 1) * words_per_block), a range
// the same size for every block (a multiple of kNibbleThreads), so all blocks of the
// SM-count-sized grid finish together; per step, thread t handles words
// base + u * kNibbleThreads + t (u < kNibbleUnroll), so every load and store
// instruction of a warp covers one contiguous range. Requires: data 4-byte aligned,
// out 16-byte aligned, and for nf4 a block size that is a multiple of 8 (a word never
// straddles two scales). Words whose 8 elements run past numel (only the last one can)
// are stored element by element.
template <QuantFormat F>
__global__ void __launch_bounds__(kNibbleThreads, kNibbleMinBlocks)
    DequantizeNibbleBf16(const uint32_t* __restrict__ words, const void* __restrict__ scales,
                         const float* __restrict__ tensor_scale, int64_t numel, int64_t block,
                         int block_shift, int64_t num_words, int64_t words_per_block,
                         __nv_bfloat16* __restrict__ out) {
  __shared__ float table[16];
  if (threadIdx.x < 16) {
    table[threadIdx.x] =
        F == QuantFormat::kNf4 ? kNf4CodeDev[threadIdx.x] : kE2m1ValueDev[threadIdx.x];
  }
  __syncthreads();
  const float* fscales = static_cast<const float*>(scales);
  const uint8_t* bscales = static_cast<const uint8_t*>(scales);
  float g = 0.0f;
  if constexpr (F == QuantFormat::kNvfp4) g = __ldg(tensor_scale);
  const int64_t begin = blockIdx.x * words_per_block;
  const int64_t end = begin + words_per_block < num_words ? begin + words_per_block : num_words;
  for (int64_t base = begin + threadIdx.x; base < end; base += kNibbleStepWords) {
    uint32_t w[kNibbleUnroll];
    float s[kNibbleUnroll];
    // All loads first (codes and scales), so kNibbleUnroll words are in flight.
#pragma unroll
    for (int u = 0; u < kNibbleUnroll; ++u) {
      const int64_t wi = base + int64_t{u} * kNibbleThreads;
      const bool in = wi < end;
      w[u] = in ? LoadWordNc(words + wi) : 0u;
      if constexpr (F == QuantFormat::kNf4) {
        const int64_t e = wi * 8;
        const int64_t b = block_shift >= 0 ? (e >> block_shift) : e / block;
        s[u] = in ? __ldg(fscales + b) : 0.0f;
      } else {
        // 16 elements a scale; the raw byte rides in s[u], decoded when used.
        s[u] = __uint_as_float(in ? __ldg(bscales + (wi >> 1)) : 0u);
      }
    }
#pragma unroll
    for (int u = 0; u < kNibbleUnroll; ++u) {
      const int64_t wi = base + int64_t{u} * kNibbleThreads;
      if (wi >= end) break;
      float scale = s[u];
      if constexpr (F == QuantFormat::kNvfp4) {
        scale = __fmul_rn(E4m3Decode(static_cast<uint8_t>(__float_as_uint(s[u]))), g);
      }
      const uint4 v = DecodeNibbleWord(w[u], table, scale);
      const int64_t e0 = wi * 8;
      if (e0 + 8 <= numel) {
        reinterpret_cast<uint4*>(out)[wi] = v;
      } else {
        uint16_t* tail = reinterpret_cast<uint16_t*>(out + e0);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const uint32_t pair = i < 2 ? v.x : i < 4 ? v.y : i < 6 ? v.z : v.w;
          if (e0 + i < numel) tail[i] = static_cast<uint16_t>(pair >> (16 * (i & 1)));
        }
      }
    }
  }
}

// One thread per element, any alignment or block size: the fallback, and the tail
// of tensors whose code bytes are not a multiple of 16.
template <typename OutT>
__global__ void DequantizeGeneric(QuantFormat fmt, const uint8_t* __restrict__ data,
                                  const void* __restrict__ scales,
                                  const float* __restrict__ tensor_scale, int64_t first,
                                  int64_t numel, int64_t block, OutT* __restrict__ out) {
  const float* fscales = static_cast<const float*>(scales);
  const uint8_t* bscales = static_cast<const uint8_t*>(scales);
  for (int64_t e = first + blockIdx.x * int64_t{kThreads} + threadIdx.x; e < numel;
       e += int64_t{gridDim.x} * kThreads) {
    const int64_t b = e / block;
    const uint8_t nibble = (e & 1) ? (data[e / 2] & 0xF) : (data[e / 2] >> 4);
    float y;
    switch (fmt) {
      case QuantFormat::kInt8:
        y = __fmul_rn(static_cast<float>(static_cast<int8_t>(data[e])),
                      __fdiv_rn(fscales[b], 127.0f));
        break;
      case QuantFormat::kNf4:
        y = __fmul_rn(kNf4CodeDev[nibble], fscales[b]);
        break;
      case QuantFormat::kFp8:
        y = __fmul_rn(E4m3Decode(data[e]), E8m0Decode(bscales[b]));
        break;
      default:
        y = __fmul_rn(kE2m1ValueDev[nibble], __fmul_rn(E4m3Decode(bscales[b]), *tensor_scale));
        break;
    }
    out[e] = FromFloat<OutT>(y);
  }
}

int GridFor(int64_t items) {
  // Enough blocks to fill an H200 several times over; the loops are grid-stride.
  const int64_t blocks = (items + kThreads - 1) / kThreads;
  return static_cast<int>(blocks < 132 * 32 ? (blocks > 0 ? blocks : 1) : 132 * 32);
}

// Blocks of `threads` threads of `kernel` that fit on the current device at once (the
// loops are grid-stride, so a larger grid would only add tail effects).
template <typename Kernel>
int ResidentBlocks(Kernel kernel, int threads) {
  int device = 0, sms = 0, per_sm = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0) != cudaSuccess ||
      sms <= 0 || per_sm <= 0) {
    (void)cudaGetLastError();
    return 132 * 4;
  }
  return sms * per_sm;
}

template <QuantFormat F>
cudaError_t LaunchNibbleBf16(const QuantLayout& l, const uint8_t* data, const void* scales,
                             const float* ts, int64_t num_words, __nv_bfloat16* out,
                             cudaStream_t stream) {
  // Queried once per device and format (each instantiation has its own statics).
  static thread_local int resident = 0;
  static thread_local int resident_device = -1;
  int device = 0;
  TS_CUDA_CHECK(cudaGetDevice(&device));
  if (resident_device != device) {
    resident = ResidentBlocks(DequantizeNibbleBf16<F>, kNibbleThreads);
    resident_device = device;
  }
  // Equal ranges of whole warps' words for at most one resident wave of blocks.
  const int64_t groups = (num_words + kNibbleThreads - 1) / kNibbleThreads;
  const int grid = static_cast<int>(groups < resident ? groups : resident);
  const int64_t words_per_block = (groups + grid - 1) / grid * kNibbleThreads;
  int shift = -1;
  if (l.block_size > 0 && (l.block_size & (l.block_size - 1)) == 0) {
    shift = 0;
    while ((int64_t{1} << shift) < l.block_size) ++shift;
  }
  DequantizeNibbleBf16<F><<<grid, kNibbleThreads, 0, stream>>>(
      reinterpret_cast<const uint32_t*>(data), scales, ts, l.numel, l.block_size, shift, num_words,
      words_per_block, out);
  TS_CUDA_LAUNCH_CHECK();
  return cudaSuccess;
}

template <QuantFormat F, typename OutT>
cudaError_t LaunchVec(const QuantLayout& l, const uint8_t* data, const void* scales,
                      const float* ts, int64_t chunks, OutT* out, cudaStream_t stream) {
  DequantizeVec<F, OutT><<<GridFor(chunks), kThreads, 0, stream>>>(data, scales, ts, l.numel,
                                                                   l.block_size, chunks, out);
  TS_CUDA_LAUNCH_CHECK();
  return cudaSuccess;
}

template <typename OutT>
cudaError_t Dequantize(QuantFormat fmt, const QuantLayout& l, const uint8_t* data,
                       const void* scales, const float* ts, OutT* out, cudaStream_t stream) {
  const bool nibbles = fmt == QuantFormat::kNf4 || fmt == QuantFormat::kNvfp4;
  const int64_t per_chunk = nibbles ? 32 : 16;
  const bool aligned =
      reinterpret_cast<uintptr_t>(data) % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0;
  const bool block_ok =
      fmt == QuantFormat::kFp8 || fmt == QuantFormat::kNvfp4 || l.block_size % per_chunk == 0;
  int64_t done = 0;  // elements handled by the vectorized kernel
  if constexpr (std::is_same_v<OutT, __nv_bfloat16>) {
    // nf4 / nvfp4 to bf16: the word kernel (4-byte aligned codes, nf4 blocks of 8k).
    const bool word_ok =
        reinterpret_cast<uintptr_t>(data) % 4 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0 &&
        (fmt == QuantFormat::kNvfp4 || (fmt == QuantFormat::kNf4 && l.block_size % 8 == 0));
    if (nibbles && word_ok) {
      const int64_t words = l.data_bytes / 4;
      if (words > 0) {
        if (fmt == QuantFormat::kNf4) {
          TS_CUDA_CHECK(
              LaunchNibbleBf16<QuantFormat::kNf4>(l, data, scales, ts, words, out, stream));
        } else {
          TS_CUDA_CHECK(
              LaunchNibbleBf16<QuantFormat::kNvfp4>(l, data, scales, ts, words, out, stream));
        }
      }
      done = words * 8 < l.numel ? words * 8 : l.numel;
      if (done < l.numel) {
        DequantizeGeneric<OutT><<<GridFor(l.numel - done), kThreads, 0, stream>>>(
            fmt, data, scales, ts, done, l.numel, l.block_size, out);
        TS_CUDA_LAUNCH_CHECK();
      }
      return cudaSuccess;
    }
  }
  if (aligned && block_ok) {
    const int64_t chunks = l.data_bytes / 16;
    if (chunks > 0) {
      switch (fmt) {
        case QuantFormat::kInt8:
          TS_CUDA_CHECK(LaunchVec<QuantFormat::kInt8>(l, data, scales, ts, chunks, out, stream));
          break;
        case QuantFormat::kNf4:
          TS_CUDA_CHECK(LaunchVec<QuantFormat::kNf4>(l, data, scales, ts, chunks, out, stream));
          break;
        case QuantFormat::kFp8:
          TS_CUDA_CHECK(LaunchVec<QuantFormat::kFp8>(l, data, scales, ts, chunks, out, stream));
          break;
        case QuantFormat::kNvfp4:
          TS_CUDA_CHECK(LaunchVec<QuantFormat::kNvfp4>(l, data, scales, ts, chunks, out, stream));
          break;
      }
    }
    done = chunks * per_chunk;
  }
  if (done < l.numel) {
    DequantizeGeneric<OutT><<<GridFor(l.numel - done), kThreads, 0, stream>>>(
        fmt, data, scales, ts, done, l.numel, l.block_size, out);
    TS_CUDA_LAUNCH_CHECK();
  }
  return cudaSuccess;
}

}  // namespace

cudaError_t DequantizeCuda(QuantFormat fmt, const QuantLayout& layout, const uint8_t* data,
                           const void* scales, const float* tensor_scale, DType dst_type, void* dst,
                           cudaStream_t stream) {
  if (!QuantTakesDType(dst_type)) return cudaErrorInvalidValue;
  if (layout.numel == 0) return cudaSuccess;
  if (dst_type == DType::kFloat32) {
    return Dequantize(fmt, layout, data, scales, tensor_scale, static_cast<float*>(dst), stream);
  }
  return Dequantize(fmt, layout, data, scales, tensor_scale, static_cast<__nv_bfloat16*>(dst),
                    stream);
}

}  // namespace trainstream::kernels
