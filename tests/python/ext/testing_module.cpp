// trainstream_testing: a test-only torch extension (tests/python/ext/CMakeLists.txt),
// never shipped. Its parts: the CPU AdamW kernel and the daemon's AdamWEngine on
// tensors (adamw_testing.cpp) and, as trainstream_testing.wire, the wire constants
// as the C++ headers define them (wire_testing.cpp).
#include <torch/extension.h>

namespace trainstream::python {
void RegisterAdamWBindings(pybind11::module_& m);  // adamw_testing.cpp
void RegisterWireBindings(pybind11::module_& m);   // wire_testing.cpp
}  // namespace trainstream::python

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() =
      "TrainStream test-only bindings: the CPU AdamW kernel, the daemon's AdamWEngine and the "
      "wire constants";
  trainstream::python::RegisterAdamWBindings(m);
  trainstream::python::RegisterWireBindings(m);
}
