// The wire's DType (proto/include/trainstream/wire/dtype.h) of a torch dtype and
// back, for the bindings that hand tensors to the kernels (AdamW, quantization) and
// view shared memory as tensors.
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

// The torch dtype of a DType; a number that is no DType throws.
inline c10::ScalarType ToScalarType(wire::DType dtype) {
  switch (dtype) {
    case wire::DType::kFloat32:
      return c10::kFloat;
    case wire::DType::kBFloat16:
      return c10::kBFloat16;
    case wire::DType::kFloat16:
      return c10::kHalf;
  }
  TS_CHECK(false, "no DType is numbered ", static_cast<uint32_t>(dtype));
  return c10::kFloat;
}

}  // namespace trainstream::python
