// The platform seam for sleeping on a 32-bit word in shared memory until
// another process changes it: the data plane's rings (wire/ring.h) and the
// daemon's ring waits sleep here instead of spinning.
//
// Note [Windows polls the shared word]. Linux has a futex on any word of a
// MAP_SHARED mapping: a waiter sleeps in the kernel and a wake costs one
// syscall. Windows' WaitOnAddress works only between threads of one process,
// so across processes it would need a named event beside each word, created
// by the daemon and opened by the client (a wire change both sides must make
// at once). Until then the Windows side polls: it rechecks the word with a
// sleep that grows from a yield to 1 ms, so a wake-up is seen within about a
// millisecond (the timer's resolution) and a wake is a no-op. The rings spin
// briefly before they sleep, so a busy ring does not pay for this; an idle one
// costs a thread about a thousand wake-ups a second.
//
// Two sides, picked by platform/CMakeLists.txt: shared_word_linux.cc
// (FUTEX_WAIT / FUTEX_WAKE without FUTEX_PRIVATE_FLAG) and
// shared_word_windows.cc (the polling above).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace trainstream::platform {

// Sleeps while `*word` holds `expected`, at most `timeout_ns` (< 0: no limit).
// Returns early, and spuriously, like a futex: callers recheck what they wait
// for. Returns 0 when woken (or the word differs), or an errno value:
// ETIMEDOUT, EINTR, EAGAIN (the word did not hold `expected`).
int SharedWordWait(std::atomic<uint32_t>* word, uint32_t expected, int64_t timeout_ns);

// Wakes every process and thread sleeping on `word` (after the caller changed
// it). Linux: FUTEX_WAKE; Windows: nothing (the waiters poll).
void SharedWordWake(std::atomic<uint32_t>* word);

// The most words SharedWordWaitAny takes (FUTEX_WAITV_MAX).
inline constexpr size_t kMaxSharedWords = 128;

// Sleeps until any `words[i]` no longer holds `expected[i]` (or is woken), at
// most `timeout_ns` (>= 0), for n <= kMaxSharedWords. Spurious returns are
// allowed, as for SharedWordWait. Returns 0, ETIMEDOUT, EAGAIN, EINTR, or
// another errno value when the system cannot wait on several words at once
// (Linux: futex_waitv is 5.16 and later, and a container's seccomp filter may
// answer EPERM or ENOSYS): then the caller waits on one word at a time.
int SharedWordWaitAny(std::atomic<uint32_t>* const* words, const uint32_t* expected, size_t n,
                      int64_t timeout_ns);

}  // namespace trainstream::platform
