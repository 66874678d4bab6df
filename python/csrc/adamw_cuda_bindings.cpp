// optimizer_mode="gpu": the zero-copy CUDA AdamW (kernels/adamw_cuda.h) on torch
// tensors. The parameter and its gradient are CUDA tensors; the moments (and the
// fp32 master of a non-fp32 parameter) are pinned host memory the caller mapped
// with register_host and passes as device addresses (host_device_address).
#include <torch/extension.h>

#include <cstdint>
#include <optional>
#include <string>

#include "check.h"
#include "torch_dtype.h"
#include "trainstream/kernels/adamw.h"

#ifdef TRAINSTREAM_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include "trainstream/kernels/adamw_cuda.h"
#endif

namespace trainstream::python {
namespace {

namespace py = pybind11;
namespace tk = trainstream::kernels;

#ifdef TRAINSTREAM_WITH_CUDA
// The device address of registered (pinned, mapped) host memory at `address`.
uintptr_t HostDeviceAddress(uintptr_t address) {
  void* device = nullptr;
  const cudaError_t err = cudaHostGetDevicePointer(&device, reinterpret_cast<void*>(address), 0);
  if (err != cudaSuccess) cudaGetLastError();
  TS_CHECK(err == cudaSuccess, "host_device_address: ", cudaGetErrorString(err),
           " (was the range registered with register_host?)");
  return reinterpret_cast<uintptr_t>(device);
}

void AdamWCudaStep(const at::Tensor& param, const at::Tensor& grad, uintptr_t master,
                   uintptr_t exp_avg, uintptr_t exp_avg_sq, const std::string& moment_dtype,
                   int64_t step, double lr, double beta1, double beta2, double eps,
                   double weight_decay, double grad_scale, int64_t seed, int64_t param_key,
                   const std::optional<at::Tensor>& skip) {
  TS_CHECK(param.is_cuda() && grad.device() == param.device(),
           "adamw_cuda_step: param and grad must be on one CUDA device, got ", param.device(),
           " and ", grad.device());
  TS_CHECK(param.is_contiguous() && grad.is_contiguous(),
           "adamw_cuda_step: param and grad must be contiguous");
  TS_CHECK(param.numel() == grad.numel(), "adamw_cuda_step: param has ", param.numel(),
           " elements, grad ", grad.numel());
  TS_CHECK(step >= 1, "adamw_cuda_step: step counts from 1, got ", step);
  tk::AdamWCudaTensors t;
  t.param = param.data_ptr();
  t.grad = grad.data_ptr();
  t.param_dtype = ToDType(param.scalar_type(), "adamw_cuda_step: param");
  t.grad_dtype = ToDType(grad.scalar_type(), "adamw_cuda_step: grad");
  TS_CHECK((t.param_dtype == tk::DType::kFloat32) == (master == 0),
           "adamw_cuda_step: a float32 parameter is its own master (pass master=0); any other "
           "dtype needs an fp32 master");
  t.master = reinterpret_cast<float*>(master);
  t.exp_avg = reinterpret_cast<void*>(exp_avg);
  t.exp_avg_sq = reinterpret_cast<void*>(exp_avg_sq);
  TS_CHECK(t.exp_avg != nullptr && t.exp_avg_sq != nullptr, "adamw_cuda_step: null moments");
  TS_CHECK(tk::ParseDType(moment_dtype, &t.moment_dtype) && t.moment_dtype != tk::DType::kFloat16,
           "adamw_cuda_step: moment_dtype '", moment_dtype,
           "'; accepted: float32 (fp32), bfloat16 (bf16)");
  t.numel = static_cast<size_t>(param.numel());
  const int32_t* skip_flag = nullptr;
  if (skip.has_value()) {
    TS_CHECK(
        skip->scalar_type() == at::kInt && skip->numel() == 1 && skip->device() == param.device(),
        "adamw_cuda_step: skip must be one int32 on the parameter's device");
    skip_flag = skip->data_ptr<int32_t>();
  }
  const tk::AdamWStepScalars s =
      tk::ComputeAdamWStepScalars(tk::AdamWHyperParams{lr, beta1, beta2, eps, weight_decay},
                                  static_cast<uint64_t>(step), static_cast<float>(grad_scale));
  const c10::cuda::CUDAGuard guard(param.device());
  const cudaError_t err =
      tk::AdamWUpdateCuda(t, s, static_cast<uint64_t>(seed), static_cast<uint64_t>(param_key),
                          static_cast<uint64_t>(step), skip_flag,
                          c10::cuda::getCurrentCUDAStream(param.device().index()).stream());
  TS_CHECK(err == cudaSuccess, "adamw_cuda_step: launch failed: ", cudaGetErrorString(err));
}

void FlagNonFinite(const at::Tensor& grad, const at::Tensor& flag) {
  TS_CHECK(grad.is_cuda() && grad.is_contiguous(), "flag_nonfinite: grad must be contiguous CUDA");
  TS_CHECK(flag.scalar_type() == at::kInt && flag.numel() == 1 && flag.device() == grad.device(),
           "flag_nonfinite: flag must be one int32 on the gradient's device");
  const c10::cuda::CUDAGuard guard(grad.device());
  const cudaError_t err =
      tk::FlagNonFiniteCuda(grad.data_ptr(), ToDType(grad.scalar_type(), "flag_nonfinite: grad"),
                            static_cast<size_t>(grad.numel()), flag.data_ptr<int32_t>(),
                            c10::cuda::getCurrentCUDAStream(grad.device().index()).stream());
  TS_CHECK(err == cudaSuccess, "flag_nonfinite: launch failed: ", cudaGetErrorString(err));
}
#endif

}  // namespace

void RegisterAdamWCudaBindings(py::module_& m) {
#ifdef TRAINSTREAM_WITH_CUDA
  m.attr("has_adamw_cuda") = true;
  m.def("host_device_address", &HostDeviceAddress, py::arg("address"));
  m.def("adamw_cuda_step", &AdamWCudaStep, py::arg("param"), py::arg("grad"), py::arg("master"),
        py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("moment_dtype"), py::arg("step"),
        py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
        py::arg("grad_scale") = 1.0, py::arg("seed") = 0, py::arg("param_key") = 0,
        py::arg("skip") = py::none(),
        "One zero-copy AdamW step of a CUDA parameter, enqueued on the current stream.");
  m.def("flag_nonfinite", &FlagNonFinite, py::arg("grad"), py::arg("flag"));
#else
  m.attr("has_adamw_cuda") = false;
#endif
}

}  // namespace trainstream::python
