// The Windows side of trainstream/platform/shared_word.h: the word is polled
// (Note [Windows polls the shared word]).
#include <windows.h>

#include <cerrno>
#include <chrono>

#include "trainstream/platform/shared_word.h"

namespace trainstream::platform {

namespace {

bool AnyChanged(std::atomic<uint32_t>* const* words, const uint32_t* expected, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (words[i]->load(std::memory_order_acquire) != expected[i]) return true;
  }
  return false;
}

}  // namespace

int SharedWordWaitAny(std::atomic<uint32_t>* const* words, const uint32_t* expected, size_t n,
                      int64_t timeout_ns) {
  if (n == 0 || n > kMaxSharedWords) return EINVAL;
  if (AnyChanged(words, expected, n)) return EAGAIN;
  const auto start = std::chrono::steady_clock::now();
  for (int round = 0;; ++round) {
    // A few yields first (a wake that is already on its way), then 1 ms sleeps.
    if (round < 16) {
      SwitchToThread();
    } else {
      Sleep(1);
    }
    if (AnyChanged(words, expected, n)) return 0;
    if (timeout_ns >= 0 &&
        std::chrono::steady_clock::now() - start >= std::chrono::nanoseconds(timeout_ns)) {
      return ETIMEDOUT;
    }
  }
}

int SharedWordWait(std::atomic<uint32_t>* word, uint32_t expected, int64_t timeout_ns) {
  return SharedWordWaitAny(&word, &expected, 1, timeout_ns);
}

void SharedWordWake(std::atomic<uint32_t>*) {}

}  // namespace trainstream::platform
