// The kernels' DType for a torch dtype, shared by the AdamW bindings (CPU and CUDA).
#pragma once

#include <c10/core/ScalarType.h>

#include "check.h"
#include "trainstream/kernels/adamw.h"

namespace trainstream::python {

// float32, bfloat16 or float16; anything else throws naming `what` and the dtype.
inline kernels::DType KernelDType(c10::ScalarType t, const char* what) {
  switch (t) {
    case c10::kFloat:
      return kernels::DType::kFloat32;
    case c10::kBFloat16:
      return kernels::DType::kBFloat16;
    case c10::kHalf:
      return kernels::DType::kFloat16;
    default:
      break;
  }
  TS_CHECK(false, what, " must be float32, bfloat16 or float16, got ", t);
  return kernels::DType::kFloat32;
}

}  // namespace trainstream::python
