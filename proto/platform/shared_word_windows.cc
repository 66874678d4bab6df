// The Windows side of trainstream/platform/shared_word.h: the word is polled
// (Note [Windows polls the shared word]).
#include <windows.h>

#include <cerrno>
#include <chrono>

#include "trainstream/platform/shared_word.h"

namespace trainstream::platform {

int SharedWordWait(std::atomic<uint32_t>* word, uint32_t expected, int64_t timeout_ns) {
  if (word->load(std::memory_order_acquire) != expected) return EAGAIN;
  const auto start = std::chrono::steady_clock::now();
  for (int round = 0;; ++round) {
    // A few yields first (a wake that is already on its way), then 1 ms sleeps.
    if (round < 16) {
      SwitchToThread();
    } else {
      Sleep(1);
    }
    if (word->load(std::memory_order_acquire) != expected) return 0;
    if (timeout_ns >= 0 &&
        std::chrono::steady_clock::now() - start >= std::chrono::nanoseconds(timeout_ns)) {
      return ETIMEDOUT;
    }
  }
}

void SharedWordWake(std::atomic<uint32_t>*) {}

}  // namespace trainstream::platform
