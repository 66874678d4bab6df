// trainstream._C: the torch extension. Data-plane copies and hooks, the CPU
// kernels on tensors, and (with CUDA) the CUDA kernels. No gRPC or protobuf here
// (docs/design.md, "Why gRPC and libtorch never share a shared object"): control-plane values
// arrive from Python as plain integers. No daemon code either, and nothing only tests use: the
// AdamW engine's bindings and the wire constants as C++ sees them are the test-only module
// trainstream_testing (tests/python/ext).
#include <torch/extension.h>

namespace trainstream::python {
void RegisterDataPlaneBindings(pybind11::module_& m);  // dataplane_bindings.cpp
void RegisterQuantBindings(pybind11::module_& m);      // quant_bindings.cpp
void RegisterAdamWCudaBindings(pybind11::module_& m);  // adamw_cuda_bindings.cpp
void RegisterVramBindings(pybind11::module_& m);       // vram_bindings.cpp
}  // namespace trainstream::python

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "TrainStream torch extension (data plane and kernels)";
#ifdef TRAINSTREAM_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
  trainstream::python::RegisterDataPlaneBindings(m);
  trainstream::python::RegisterQuantBindings(m);
  trainstream::python::RegisterAdamWCudaBindings(m);
  trainstream::python::RegisterVramBindings(m);
}
