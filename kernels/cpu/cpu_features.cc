#include "trainstream/kernels/cpu_features.h"

#include <cstdlib>

namespace trainstream::kernels {
namespace {

bool DetectAvx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

bool DetectAvx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && DetectAvx2();
}

}  // namespace

bool IsaSupported(Isa isa) {
  switch (isa) {
    case Isa::kScalar:
      return true;
    case Isa::kAvx2:
      return DetectAvx2();
    case Isa::kAvx512:
      return DetectAvx512();
  }
  return false;
}

bool CpuHasAvx512Bf16() {
  __builtin_cpu_init();
  return DetectAvx512() && __builtin_cpu_supports("avx512bf16");
}

const char* IsaName(Isa isa) {
  switch (isa) {
    case Isa::kScalar:
      return "scalar";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kAvx512:
      return "avx512";
  }
  return "unknown";
}

bool ParseIsa(std::string_view name, Isa* out) {
  if (name == "scalar")
    *out = Isa::kScalar;
  else if (name == "avx2")
    *out = Isa::kAvx2;
  else if (name == "avx512")
    *out = Isa::kAvx512;
  else
    return false;
  return true;
}

Isa BestIsa() {
  Isa best = IsaSupported(Isa::kAvx512) ? Isa::kAvx512
             : IsaSupported(Isa::kAvx2) ? Isa::kAvx2
                                        : Isa::kScalar;
  if (const char* env = std::getenv("TRAINSTREAM_ISA")) {
    Isa wanted;
    if (ParseIsa(env, &wanted) && wanted <= best) return wanted;
  }
  return best;
}

}  // namespace trainstream::kernels
