// Run-time CPU feature detection: which SIMD path a kernel may take.
#pragma once

#include <string>
#include <string_view>

namespace trainstream::kernels {

// Instruction-set paths, in increasing order of capability.
enum class Isa {
  kScalar = 0,
  kAvx2 = 1,    // AVX2 + FMA + F16C
  kAvx512 = 2,  // AVX-512 F/BW/VL/DQ (+ BF16 conversions where the CPU has them)
};

// The best path this CPU supports, honouring TRAINSTREAM_ISA=scalar|avx2|avx512
// when set (an unsupported request falls back to the best supported path).
Isa BestIsa();

// True if this CPU can run `isa`.
bool IsaSupported(Isa isa);

// True if the CPU has AVX512_BF16 (vcvtne2ps2bf16).
bool CpuHasAvx512Bf16();

const char* IsaName(Isa isa);

// Parses "scalar", "avx2" or "avx512"; returns false for anything else.
bool ParseIsa(std::string_view name, Isa* out);

}  // namespace trainstream::kernels
