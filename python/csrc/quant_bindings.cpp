// Quantization ops on torch tensors: thin wrappers over kernels/ (quant.h on CPU,
// quant_cuda.h on CUDA, current stream). Checks and messages for users live in
// python/trainstream/quantization.py; the TS_CHECKs here guard the kernels'
// preconditions against direct callers.
#include <torch/extension.h>

#include <string>

#include "check.h"
#include "torch_dtype.h"
#include "trainstream/kernels/quant.h"

#ifdef TRAINSTREAM_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "trainstream/kernels/quant_cuda.h"
#endif

namespace trainstream::python {
namespace {

namespace tk = trainstream::kernels;

tk::QuantFormat FormatOrThrow(const std::string& name) {
  tk::QuantFormat fmt;
  if (!tk::ParseQuantFormat(name, &fmt)) {
    throw pybind11::value_error("unknown quantization format '" + name +
                                "': use one of 'int8', 'nf4', 'fp8', 'nvfp4'");
  }
  return fmt;
}

tk::QuantLayout LayoutOrThrow(tk::QuantFormat fmt, int64_t numel, int64_t block_size) {
  const std::string err = tk::QuantArgsError(fmt, block_size);
  if (!err.empty()) throw pybind11::value_error(err);
  return tk::MakeQuantLayout(fmt, numel, block_size);
}

tk::QuantCpuOptions CpuOptions(const std::string& isa) {
  tk::QuantCpuOptions opts;
  opts.num_threads = at::get_num_threads();
  if (!isa.empty() && !tk::ParseIsa(isa, &opts.isa)) {
    throw pybind11::value_error("isa='" + isa + "': use 'scalar', 'avx2' or 'avx512'");
  }
  return opts;
}

tk::DType ElemType(at::ScalarType t) {
  TS_CHECK(t == at::kFloat || t == at::kBFloat16,
           "quantization kernels take float32 or bfloat16, got ", t);
  return ToDType(t, "a quantization kernel's tensor");
}

// Returns (data uint8, scales float32 or uint8, tensor_scale float32[1]) on t's device.
std::tuple<at::Tensor, at::Tensor, at::Tensor> Quantize(const at::Tensor& t,
                                                        const std::string& format,
                                                        int64_t block_size,
                                                        const std::string& isa) {
  const tk::QuantFormat fmt = FormatOrThrow(format);
  const at::Tensor src = t.contiguous();
  const tk::QuantLayout l = LayoutOrThrow(fmt, src.numel(), block_size);
  const tk::DType type = ElemType(src.scalar_type());
  const auto bytes = src.options().dtype(at::kByte);
  at::Tensor data = at::empty({l.data_bytes}, bytes);
  at::Tensor scales = l.scale_bytes_each == 4
                          ? at::empty({l.num_blocks}, src.options().dtype(at::kFloat))
                          : at::empty({l.num_blocks}, bytes);
  at::Tensor tensor_scale = at::zeros({1}, src.options().dtype(at::kFloat));
  tk::QuantBuffers out{data.data_ptr<uint8_t>(), scales.data_ptr(), tensor_scale.data_ptr<float>()};
  if (src.is_cpu()) {
    const tk::QuantCpuOptions opts = CpuOptions(isa);
    pybind11::gil_scoped_release no_gil;
    tk::QuantizeCpu(fmt, l, type, src.data_ptr(), out, opts);
    return {data, scales, tensor_scale};
  }
#ifdef TRAINSTREAM_WITH_CUDA
  TS_CHECK(src.is_cuda(), "quantize: tensor must be on CPU or CUDA, got ", src.device());
  const c10::cuda::CUDAGuard guard(src.device());
  at::Tensor workspace = at::empty({1}, src.options().dtype(at::kInt));
  const cudaError_t err = tk::QuantizeCuda(
      fmt, l, type, src.data_ptr(), out, reinterpret_cast<uint32_t*>(workspace.data_ptr<int32_t>()),
      c10::cuda::getCurrentCUDAStream(src.device().index()).stream());
  TS_CHECK(err == cudaSuccess, "trainstream quantize (", format,
           ") on CUDA failed: ", cudaGetErrorString(err));
  return {data, scales, tensor_scale};
#else
  TS_CHECK(false, "quantize: trainstream._C was built without CUDA; tensor is on ", src.device());
#endif
}

// Returns a flat tensor of `numel` elements of out_dtype (float32 or bfloat16).
at::Tensor Dequantize(const at::Tensor& data, const at::Tensor& scales,
                      const at::Tensor& tensor_scale, const std::string& format, int64_t numel,
                      int64_t block_size, at::ScalarType out_dtype, const std::string& isa) {
  const tk::QuantFormat fmt = FormatOrThrow(format);
  const tk::QuantLayout l = LayoutOrThrow(fmt, numel, block_size);
  TS_CHECK(data.scalar_type() == at::kByte && data.is_contiguous() && data.numel() == l.data_bytes,
           "dequantize: data must be a contiguous uint8 tensor of ", l.data_bytes, " bytes");
  TS_CHECK(scales.is_contiguous() && scales.nbytes() == static_cast<size_t>(l.scale_bytes()),
           "dequantize: scales must be contiguous, ", l.scale_bytes(), " bytes");
  TS_CHECK(scales.device() == data.device() && tensor_scale.device() == data.device(),
           "dequantize: data, scales and tensor_scale must be on one device");
  const tk::DType type = ElemType(out_dtype);
  at::Tensor out = at::empty({numel}, data.options().dtype(out_dtype));
  if (data.is_cpu()) {
    const float ts = tensor_scale.to(at::kFloat).item<float>();
    const tk::QuantCpuOptions opts = CpuOptions(isa);
    pybind11::gil_scoped_release no_gil;
    tk::DequantizeCpu(fmt, l, {data.data_ptr<uint8_t>(), scales.data_ptr(), ts}, type,
                      out.data_ptr(), opts);
    return out;
  }
#ifdef TRAINSTREAM_WITH_CUDA
  const c10::cuda::CUDAGuard guard(data.device());
  const at::Tensor ts = tensor_scale.to(at::kFloat).contiguous();
  const cudaError_t err = tk::DequantizeCuda(
      fmt, l, data.data_ptr<uint8_t>(), scales.data_ptr(), ts.data_ptr<float>(), type,
      out.data_ptr(), c10::cuda::getCurrentCUDAStream(data.device().index()).stream());
  TS_CHECK(err == cudaSuccess, "trainstream dequantize (", format,
           ") on CUDA failed: ", cudaGetErrorString(err));
  return out;
#else
  TS_CHECK(false, "dequantize: trainstream._C was built without CUDA; data is on ", data.device());
#endif
}

// (q float8_e4m3fn [rows, cols], scale float32 [rows, 1]) for a CUDA tensor of rows
// (2-D, float32 / bfloat16 / float16): QuantLinear's FP8 activations, in one kernel.
std::tuple<at::Tensor, at::Tensor> QuantizeRowsE4m3(const at::Tensor& x) {
  TS_CHECK(x.dim() == 2, "quantize_rows_e4m3: x must be 2-D, got ", x.dim(), " dims");
  TS_CHECK(x.size(1) > 0, "quantize_rows_e4m3: rows must not be empty");
#ifdef TRAINSTREAM_WITH_CUDA
  TS_CHECK(x.is_cuda(), "quantize_rows_e4m3: x must be a CUDA tensor, got ", x.device());
  const tk::DType type = ToDType(x.scalar_type(), "quantize_rows_e4m3: x");
  const at::Tensor src = x.contiguous();
  const c10::cuda::CUDAGuard guard(src.device());
  at::Tensor q = at::empty({src.size(0), src.size(1)}, src.options().dtype(at::kFloat8_e4m3fn));
  at::Tensor scale = at::empty({src.size(0), 1}, src.options().dtype(at::kFloat));
  const cudaError_t err = tk::QuantizeRowsE4m3Cuda(
      type, src.data_ptr(), src.size(0), src.size(1), static_cast<uint8_t*>(q.data_ptr()),
      scale.data_ptr<float>(), c10::cuda::getCurrentCUDAStream(src.device().index()).stream());
  TS_CHECK(err == cudaSuccess,
           "trainstream quantize_rows_e4m3 on CUDA failed: ", cudaGetErrorString(err));
  return {q, scale};
#else
  TS_CHECK(false, "quantize_rows_e4m3: trainstream._C was built without CUDA");
#endif
}

}  // namespace

void RegisterQuantBindings(pybind11::module_& m) {
  auto q = m.def_submodule("quant", "Quantized storage kernels (int8, nf4, fp8, nvfp4)");
  q.def("quantize", &Quantize, pybind11::arg("tensor"), pybind11::arg("format"),
        pybind11::arg("block_size") = 64, pybind11::arg("isa") = "",
        "Quantize a contiguous float32/bfloat16 tensor (CPU or CUDA). Returns (data, "
        "scales, tensor_scale). isa: '' (best), 'scalar', 'avx2', 'avx512' (CPU only).");
  q.def("dequantize", &Dequantize, pybind11::arg("data"), pybind11::arg("scales"),
        pybind11::arg("tensor_scale"), pybind11::arg("format"), pybind11::arg("numel"),
        pybind11::arg("block_size"), pybind11::arg("dtype"), pybind11::arg("isa") = "",
        "Dequantize to a flat float32/bfloat16 tensor of numel elements on data's device.");
  q.def(
      "layout",
      [](const std::string& format, int64_t numel, int64_t block_size) {
        const tk::QuantLayout l = LayoutOrThrow(FormatOrThrow(format), numel, block_size);
        pybind11::dict d;
        d["numel"] = l.numel;
        d["block_size"] = l.block_size;
        d["num_blocks"] = l.num_blocks;
        d["padded_numel"] = l.padded_numel;
        d["padding"] = l.padding();
        d["data_bytes"] = l.data_bytes;
        d["scale_bytes"] = l.scale_bytes();
        return d;
      },
      pybind11::arg("format"), pybind11::arg("numel"), pybind11::arg("block_size") = 64);
  q.def("quantize_rows_e4m3", &QuantizeRowsE4m3, pybind11::arg("x"),
        "Per-row e4m3 quantization of a 2-D CUDA tensor for torch._scaled_mm's row-wise "
        "mode: returns (q float8_e4m3fn [rows, cols], scale float32 [rows, 1]) with "
        "scale = max(row_amax * fp32(1/448), 1e-30) and q = e4m3(x / scale), in one kernel.");
  q.def("best_isa", [] { return std::string(tk::IsaName(tk::BestIsa())); });
  q.def("isa_supported", [](const std::string& isa) {
    tk::Isa i;
    return tk::ParseIsa(isa, &i) && tk::IsaSupported(i);
  });
}

}  // namespace trainstream::python
