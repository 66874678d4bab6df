// quant_kernels_inl.h compiled with AVX2 + FMA + F16C (kernels/CMakeLists.txt sets the
// flags from the file name). No a*b+c appears in the kernels, so FMA cannot change a
// byte (Note [Identical bytes on CPU and CUDA]).
#include "quant_kernels.h"

#define TS_QUANT_ISA_NS avx2
#include "quant_kernels_inl.h"
