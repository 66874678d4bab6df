// The CUDA check macros of the quantization kernels (c10's family, small):
//   TS_CUDA_CHECK(expr)       return the error from the enclosing function on failure
//   TS_CUDA_WARN(expr)        log a failure to stderr and carry on (cleanup paths)
//   TS_CUDA_IGNORE(expr)      deliberately drop an error, clearing the sticky state
//   TS_CUDA_LAUNCH_CHECK()    after every kernel launch: return the launch error
// Kernels sit below the project's logging (kernels/ has no dependencies), so the
// functions here return cudaError_t and the caller turns it into a message.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdio>

#define TS_CUDA_CHECK(expr)                     \
  do {                                          \
    const cudaError_t ts_err_ = (expr);         \
    if (ts_err_ != cudaSuccess) return ts_err_; \
  } while (0)

#define TS_CUDA_WARN(expr)                                                                  \
  do {                                                                                      \
    const cudaError_t ts_err_ = (expr);                                                     \
    if (ts_err_ != cudaSuccess) {                                                           \
      std::fprintf(stderr, "trainstream: CUDA warning: %s at %s:%d: %s\n", #expr, __FILE__, \
                   __LINE__, cudaGetErrorString(ts_err_));                                  \
    }                                                                                       \
  } while (0)

#define TS_CUDA_IGNORE(expr)  \
  do {                        \
    (void)(expr);             \
    (void)cudaGetLastError(); \
  } while (0)

#define TS_CUDA_LAUNCH_CHECK() TS_CUDA_CHECK(cudaGetLastError())
