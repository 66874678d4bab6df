// A minimal parallel-for for the quantization kernels: splits [0, n) into contiguous
// ranges, one per thread, and runs them on short-lived std::threads. A base loader
// quantizes one large tensor at a time, so spawning per call costs little next to
// the work (tens of microseconds against milliseconds).
#pragma once

#include <cstdint>
#include <functional>

namespace trainstream::kernels::quant_internal {

// Runs fn(begin, end) over disjoint ranges covering [0, n), using at most
// `max_threads` threads (0: hardware concurrency) and at least `min_per_thread`
// items per thread. Runs inline when one thread suffices. Returns when all are done.
void ParallelFor(int64_t n, int64_t min_per_thread, int max_threads,
                 const std::function<void(int64_t, int64_t)>& fn);

}  // namespace trainstream::kernels::quant_internal
