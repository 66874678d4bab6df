// The wire's DType (proto/include/trainstream/wire/dtype.h) of a torch dtype, for
// the bindings that hand tensors to the kernels (CPU and CUDA AdamW).
#pragma once

#include <c10/core/ScalarType.h>

#include "check.h"
#include "trainstream/wire/dtype.h"

namespace trainstream::python {

// float32, bfloat16 or float16; anything else throws naming `what` and the dtype.
inline wire::DType ToDType(c10::ScalarType t, const char* what) {
  switch (t) {
    case c10::kFloat:
      return wire::DType::kFloat32;
    case c10::kBFloat16:
      return wire::DType::kBFloat16;
    case c10::kHalf:
      return wire::DType::kFloat16;
    default:
      break;
  }
  TS_CHECK(false, what, " must be float32, bfloat16 or float16, got ", t);
  return wire::DType::kFloat32;
}

}  // namespace trainstream::python
