#include <torch/extension.h>

namespace trainstream::python {

void RegisterAdamWBindings(pybind11::module_& m) {}

}  // namespace trainstream::python
