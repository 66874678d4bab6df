#include <torch/extension.h>

namespace trainstream::python {

void RegisterDataPlaneBindings(pybind11::module_& m) {}

}  // namespace trainstream::python
