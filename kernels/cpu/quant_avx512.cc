// quant_kernels_inl.h compiled with AVX-512 F/BW/VL/DQ (flags from the file name).
#include "quant_kernels.h"

#define TS_QUANT_ISA_NS avx512
#include "quant_kernels_inl.h"
