// The element types of tensors the daemon stores or stages: the one DType of the
// project. The kernels (kernels::DType), the C++ client (trainstream::DType), the
// daemon and the torch extension all name this enum; nothing converts between
// numberings.
//
// Note [DType numbers are the wire's]. The numbers cross process boundaries: in
// the state segment's manifest (segment_header.h, StateManifest::moment_dtype and
// StateManifestEntry::dtype) and as trainstream.v1.DType in control requests,
// whose DTYPE_UNSPECIFIED = 0 is why kFloat32 is 1, not 0. They never change:
// daemon/sessions/param_layout.cc static_asserts them against the generated
// trainstream.v1.DType, and tests/python/test_wire_constants.py pins them as
// trainstream._C.wire exports them.
#pragma once

#include <cstddef>
#include <cstdint>

namespace trainstream::wire {

enum class DType : uint32_t { kFloat32 = 1, kBFloat16 = 2, kFloat16 = 3 };

// Bytes per element; 0 for a number that is no DType (a value from a request or a
// file, cast before it was checked).
constexpr size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return 4;
    case DType::kBFloat16:
    case DType::kFloat16:
      return 2;
  }
  return 0;
}

}  // namespace trainstream::wire
