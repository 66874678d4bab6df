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
// the test-only trainstream_testing.wire exports them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

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

// Every name ParseDType accepts, for an error that says what is accepted
// ("moment_dtype must be one of " + kDTypeNames + ...).
inline constexpr std::string_view kDTypeNames = "float32 (fp32), bfloat16 (bf16), float16 (fp16)";

// The DType called `name`: torch's name ("float32", "bfloat16", "float16") or the
// short one ("fp32", "bf16", "fp16"), case-sensitive. False, leaving *out as it was,
// for anything else. The one parser of a dtype's name: the Python bindings, the
// kernels' callers and the benchmarks all use it.
constexpr bool ParseDType(std::string_view name, DType* out) {
  if (name == "float32" || name == "fp32") {
    *out = DType::kFloat32;
  } else if (name == "bfloat16" || name == "bf16") {
    *out = DType::kBFloat16;
  } else if (name == "float16" || name == "fp16") {
    *out = DType::kFloat16;
  } else {
    return false;
  }
  return true;
}

// The short name ("fp32", "bf16", "fp16"), which ParseDType reads back; "unknown"
// for a number that is no DType.
constexpr const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "fp32";
    case DType::kBFloat16:
      return "bf16";
    case DType::kFloat16:
      return "fp16";
  }
  return "unknown";
}

}  // namespace trainstream::wire
