#include "quant_parallel.h"

#include <algorithm>
#include <thread>
#include <vector>

namespace trainstream::kernels::quant_internal {

void ParallelFor(int64_t n, int64_t min_per_thread, int max_threads,
                 const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  int64_t threads = max_threads > 0 ? max_threads : std::thread::hardware_concurrency();
  threads = std::max<int64_t>(1, threads);
  threads =
      std::min<int64_t>(threads, std::max<int64_t>(1, n / std::max<int64_t>(1, min_per_thread)));
  if (threads == 1) {
    fn(0, n);
    return;
  }
  const int64_t per = (n + threads - 1) / threads;
  std::vector<std::thread> pool;
  pool.reserve(threads - 1);
  // The calling thread takes the first range instead of idling in join().
  for (int64_t t = 1; t < threads; ++t) {
    const int64_t begin = t * per;
    const int64_t end = std::min(n, begin + per);
    if (begin >= end) break;
    pool.emplace_back([&fn, begin, end] { fn(begin, end); });
  }
  fn(0, std::min(n, per));
  for (auto& th : pool) th.join();
}

}  // namespace trainstream::kernels::quant_internal
