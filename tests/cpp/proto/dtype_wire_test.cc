// The one parser of a dtype's name (trainstream/wire/dtype.h): every name it
// accepts, what it refuses, and that kDTypeNames lists exactly those names.
#include <string>
#include <string_view>

#include "catch_compat.h"
#include "trainstream/wire/dtype.h"

using trainstream::wire::DType;
using trainstream::wire::DTypeName;
using trainstream::wire::kDTypeNames;
using trainstream::wire::ParseDType;

namespace {

DType Parsed(std::string_view name) {
  DType d = static_cast<DType>(0);
  REQUIRE(ParseDType(name, &d));
  return d;
}

}  // namespace

TEST_CASE("torch's names and the short ones parse to the same DType", "[dtype]") {
  CHECK(Parsed("float32") == DType::kFloat32);
  CHECK(Parsed("fp32") == DType::kFloat32);
  CHECK(Parsed("bfloat16") == DType::kBFloat16);
  CHECK(Parsed("bf16") == DType::kBFloat16);
  CHECK(Parsed("float16") == DType::kFloat16);
  CHECK(Parsed("fp16") == DType::kFloat16);
}

TEST_CASE("any other name is refused and leaves the output alone", "[dtype]") {
  for (const char* name : {"", "float", "half", "FP32", "float64", "uint8", "bf16 ", "fp8"}) {
    DType d = DType::kFloat16;
    CHECK_FALSE(ParseDType(name, &d));
    CHECK(d == DType::kFloat16);
  }
}

TEST_CASE("DTypeName reads back through ParseDType", "[dtype]") {
  for (DType d : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    CHECK(Parsed(DTypeName(d)) == d);
  }
  CHECK(std::string(DTypeName(static_cast<DType>(9))) == "unknown");
}

TEST_CASE("the accepted names an error lists are the names that parse", "[dtype]") {
  const std::string names(kDTypeNames);
  for (const char* name : {"float32", "fp32", "bfloat16", "bf16", "float16", "fp16"}) {
    CHECK(names.find(name) != std::string::npos);
  }
  static_assert(
      [] {
        DType d{};
        return ParseDType("bf16", &d) && d == DType::kBFloat16;
      }(),
      "ParseDType is usable at compile time");
}
