// TS_HOST_DEVICE marks the few scalar helpers (bf16 rounding, the counter RNG)
// that the CPU kernels and the CUDA kernels share, so both compute the same bits
// from one definition.
#pragma once

#if defined(__CUDACC__)
#define TS_HOST_DEVICE __host__ __device__
#else
#define TS_HOST_DEVICE
#endif
