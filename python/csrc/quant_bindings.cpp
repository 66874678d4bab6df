#include <torch/extension.h>

namespace trainstream::python {

void RegisterQuantBindings(pybind11::module_& m) {}

}  // namespace trainstream::python
