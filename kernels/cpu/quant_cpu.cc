// Public CPU entry points: argument checks, instruction-set dispatch and threading.
// The kernels themselves are in quant_kernels_inl.h.
#include <algorithm>
#include <atomic>
#include <thread>
#include <vector>

#include "quant_kernels.h"
#include "quant_parallel.h"
#include "trainstream/kernels/quant.h"

namespace trainstream::kernels {
namespace {

// Below this many elements per thread, spawning a thread costs more than it saves.
constexpr int64_t kMinElementsPerThread = 1 << 16;

struct IsaKernels {
  float (*abs_max)(DType, const void*, int64_t, int64_t);
  void (*quantize)(QuantFormat, const QuantLayout&, DType, const void*, const QuantBuffers&, float,
                   int64_t, int64_t);
  void (*dequantize)(QuantFormat, const QuantLayout&, const QuantConstBuffers&, DType, void*,
                     int64_t, int64_t);
};

IsaKernels KernelsFor(Isa requested) {
  // An unsupported request falls back to the best supported path, like BestIsa().
  Isa isa = IsaSupported(requested) ? requested : BestIsa();
  switch (isa) {
    case Isa::kAvx512:
      return {quant_internal::avx512::AbsMaxRange, quant_internal::avx512::QuantizeBlocks,
              quant_internal::avx512::DequantizeBlocks};
    case Isa::kAvx2:
      return {quant_internal::avx2::AbsMaxRange, quant_internal::avx2::QuantizeBlocks,
              quant_internal::avx2::DequantizeBlocks};
    case Isa::kScalar:
      break;
  }
  return {quant_internal::scalar::AbsMaxRange, quant_internal::scalar::QuantizeBlocks,
          quant_internal::scalar::DequantizeBlocks};
}

int64_t MinBlocksPerThread(const QuantLayout& l) {
  return std::max<int64_t>(1, kMinElementsPerThread / l.block_size);
}

// The whole tensor's largest |x|, split over threads.
float ParallelAbsMax(const IsaKernels& k, DType type, const void* src, int64_t n, int threads) {
  std::vector<float> partial(std::max(1, threads), 0.0f);
  std::atomic<int> slot{0};
  quant_internal::ParallelFor(n, kMinElementsPerThread, threads, [&](int64_t b, int64_t e) {
    const int s = slot.fetch_add(1);
    partial[s] = k.abs_max(type, src, b, e);
  });
  float amax = 0.0f;
  for (float p : partial) amax = std::max(amax, p);
  return amax;
}

int ThreadsFor(const QuantCpuOptions& opts) {
  return opts.num_threads > 0 ? opts.num_threads
                              : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

}  // namespace

bool ParseQuantFormat(std::string_view name, QuantFormat* out) {
  if (name == "int8")
    *out = QuantFormat::kInt8;
  else if (name == "nf4")
    *out = QuantFormat::kNf4;
  else if (name == "fp8")
    *out = QuantFormat::kFp8;
  else if (name == "nvfp4")
    *out = QuantFormat::kNvfp4;
  else
    return false;
  return true;
}

const char* QuantFormatName(QuantFormat fmt) {
  switch (fmt) {
    case QuantFormat::kInt8:
      return "int8";
    case QuantFormat::kNf4:
      return "nf4";
    case QuantFormat::kFp8:
      return "fp8";
    case QuantFormat::kNvfp4:
      return "nvfp4";
  }
  return "unknown";
}

std::string QuantArgsError(QuantFormat fmt, int64_t block_size) {
  if (fmt == QuantFormat::kFp8 || fmt == QuantFormat::kNvfp4) return "";
  if (block_size < 2 || block_size % 2 != 0) {
    return "block_size=" + std::to_string(block_size) + " is not accepted for " +
           QuantFormatName(fmt) + ": use an even integer >= 2 (default 64)";
  }
  return "";
}

float Nvfp4TensorScale(float amax) { return amax / (kE2m1Max * kE4m3Max); }

float AbsMaxCpu(DType src_type, const void* src, int64_t n, const QuantCpuOptions& opts) {
  if (n <= 0) return 0.0f;
  return ParallelAbsMax(KernelsFor(opts.isa), src_type, src, n, ThreadsFor(opts));
}

void QuantizeCpu(QuantFormat fmt, const QuantLayout& l, DType src_type, const void* src,
                 const QuantBuffers& out, const QuantCpuOptions& opts) {
  if (l.num_blocks == 0) {
    if (out.tensor_scale != nullptr) *out.tensor_scale = 0.0f;
    return;
  }
  const IsaKernels k = KernelsFor(opts.isa);
  const int threads = ThreadsFor(opts);
  float tensor_scale = 0.0f;
  if (fmt == QuantFormat::kNvfp4) {
    tensor_scale = Nvfp4TensorScale(ParallelAbsMax(k, src_type, src, l.numel, threads));
    if (out.tensor_scale != nullptr) *out.tensor_scale = tensor_scale;
  }
  quant_internal::ParallelFor(l.num_blocks, MinBlocksPerThread(l), threads,
                              [&](int64_t b0, int64_t b1) {
                                k.quantize(fmt, l, src_type, src, out, tensor_scale, b0, b1);
                              });
}

void QuantizeBlockRangeCpu(QuantFormat fmt, const QuantLayout& l, DType src_type, const void* src,
                           int64_t first_block, int64_t end_block, const QuantBuffers& out,
                           float tensor_scale, const QuantCpuOptions& opts) {
  if (end_block <= first_block) return;
  // The piece as a tensor of its own: the kernels index blocks from the layout's
  // start and pad past its numel, and a block's bytes depend only on its elements
  // (and nvfp4's tensor scale). Blocks have an even size, so a piece of a nibble
  // format starts on a byte.
  QuantLayout piece = l;
  const int64_t first_elem = first_block * l.block_size;
  piece.numel = std::min(l.numel, end_block * l.block_size) - first_elem;
  piece.num_blocks = end_block - first_block;
  piece.padded_numel = piece.num_blocks * l.block_size;
  const bool nibbles = fmt == QuantFormat::kNf4 || fmt == QuantFormat::kNvfp4;
  piece.data_bytes = nibbles ? piece.padded_numel / 2 : piece.padded_numel;
  QuantBuffers at;
  at.data = out.data + (nibbles ? first_elem / 2 : first_elem);
  at.scales = static_cast<uint8_t*>(out.scales) + first_block * l.scale_bytes_each;
  at.tensor_scale = nullptr;
  const IsaKernels k = KernelsFor(opts.isa);
  quant_internal::ParallelFor(piece.num_blocks, MinBlocksPerThread(piece), ThreadsFor(opts),
                              [&](int64_t b0, int64_t b1) {
                                k.quantize(fmt, piece, src_type, src, at, tensor_scale, b0, b1);
                              });
}

void DequantizeCpu(QuantFormat fmt, const QuantLayout& l, const QuantConstBuffers& in,
                   DType dst_type, void* dst, const QuantCpuOptions& opts) {
  const IsaKernels k = KernelsFor(opts.isa);
  quant_internal::ParallelFor(
      l.num_blocks, MinBlocksPerThread(l), opts.num_threads,
      [&](int64_t b0, int64_t b1) { k.dequantize(fmt, l, in, dst_type, dst, b0, b1); });
}

}  // namespace trainstream::kernels
