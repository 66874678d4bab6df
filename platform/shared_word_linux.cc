// The Linux side of trainstream/platform/shared_word.h: a futex on a word in a
// MAP_SHARED mapping (no FUTEX_PRIVATE_FLAG: the waker is another process).
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <ctime>

#include "trainstream/platform/shared_word.h"

namespace trainstream::platform {

int SharedWordWait(std::atomic<uint32_t>* word, uint32_t expected, int64_t timeout_ns) {
  timespec ts{};
  const timespec* tp = nullptr;
  if (timeout_ns >= 0) {
    ts.tv_sec = static_cast<time_t>(timeout_ns / 1000000000);
    ts.tv_nsec = static_cast<long>(timeout_ns % 1000000000);
    tp = &ts;
  }
  const long rc =
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, tp, nullptr, 0);
  return rc == 0 ? 0 : errno;
}

void SharedWordWake(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

int SharedWordWaitAny(std::atomic<uint32_t>* const* words, const uint32_t* expected, size_t n,
                      int64_t timeout_ns) {
  if (n == 0 || n > kMaxSharedWords) return EINVAL;
  struct Waiter {  // struct futex_waitv (linux/futex.h, 5.16)
    uint64_t val;
    uint64_t uaddr;
    uint32_t flags;
    uint32_t reserved;
  };
  constexpr uint32_t kFutex32 = 2;      // FUTEX_32; no FUTEX_PRIVATE_FLAG: the words are shared
  constexpr long kSysFutexWaitv = 449;  // the same number on every architecture
  Waiter w[kMaxSharedWords];
  for (size_t i = 0; i < n; ++i) {
    w[i] = Waiter{expected[i], reinterpret_cast<uint64_t>(words[i]), kFutex32, 0};
  }
  timespec deadline{};
  clock_gettime(CLOCK_MONOTONIC, &deadline);
  deadline.tv_sec += static_cast<time_t>(timeout_ns / 1000000000);
  deadline.tv_nsec += static_cast<long>(timeout_ns % 1000000000);
  if (deadline.tv_nsec >= 1000000000) {
    deadline.tv_nsec -= 1000000000;
    ++deadline.tv_sec;
  }
  return syscall(kSysFutexWaitv, w, static_cast<unsigned>(n), 0u, &deadline, CLOCK_MONOTONIC) < 0
             ? errno
             : 0;
}

}  // namespace trainstream::platform
