// The reference path: the kernels of quant_kernels_inl.h with auto-vectorization off,
// so the tests can check the vectorized paths against plain one-element-at-a-time code.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-tree-vectorize", "no-tree-slp-vectorize")
#endif

#include "quant_kernels.h"

#define TS_QUANT_ISA_NS scalar
#include "quant_kernels_inl.h"
