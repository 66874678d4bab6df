// A quant-only trainstream._C, for machines that cannot build the full extension
// (the GPU host has no gRPC). Same bindings as python/csrc/module.cpp's quant
// submodule; benchmarks/quant/build_quant_ext.py compiles it.
#include <torch/extension.h>

namespace trainstream::python {
void RegisterQuantBindings(pybind11::module_& m);  // python/csrc/quant_bindings.cpp
}  // namespace trainstream::python

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "TrainStream torch extension, quantization kernels only (build_quant_ext.py)";
#ifdef TRAINSTREAM_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
  trainstream::python::RegisterQuantBindings(m);
}
