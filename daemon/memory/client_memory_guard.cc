#include "memory/client_memory_guard.h"

#include <signal.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>

namespace trainstream::daemon {
namespace {

// A range's life: kFree -> kClaimed (being filled in) -> kActive -> kFaulted
// -> kReported (TakeFaults returned it) -> kFree (Unregister).
enum : uint32_t { kFree = 0, kClaimed, kActive, kFaulted, kReported };

// Read by the signal handler, so only lock-free atomics (no allocation, no locks).
struct Range {
  std::atomic<uint32_t> state{kFree};
  std::atomic<uintptr_t> begin{0};
  std::atomic<uintptr_t> end{0};
  std::atomic<uint64_t> owner{0};
};
static_assert(std::atomic<uintptr_t>::is_always_lock_free, "used in a signal handler");

Range g_ranges[ClientMemoryGuard::kMaxRanges];
std::atomic<size_t> g_high{0};  // ranges [0, g_high) may be in use
std::atomic<int> g_event_fd{-1};
struct sigaction g_previous {};
std::once_flag g_install_once;
std::string g_install_error;

void OnSigbus(int sig, siginfo_t* info, void* ucontext) {
  const auto addr = reinterpret_cast<uintptr_t>(info->si_addr);
  const size_t high = g_high.load(std::memory_order_acquire);
  for (size_t i = 0; i < high; ++i) {
    Range& r = g_ranges[i];
    const uint32_t st = r.state.load(std::memory_order_acquire);
    if (st != kActive && st != kFaulted && st != kReported) continue;
    const uintptr_t b = r.begin.load(std::memory_order_relaxed);
    const uintptr_t e = r.end.load(std::memory_order_relaxed);
    if (addr < b || addr >= e) continue;
    // Replace the whole mapping: the client's file is no longer trusted, and
    // the next access retries on these private zero pages.
    const int saved_errno = errno;
    void* p = mmap(reinterpret_cast<void*>(b), e - b, PROT_READ | PROT_WRITE,
                   MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    uint32_t expected = kActive;
    r.state.compare_exchange_strong(expected, kFaulted, std::memory_order_acq_rel);
    const int fd = g_event_fd.load(std::memory_order_relaxed);
    if (fd >= 0) {
      const uint64_t one = 1;
      ssize_t ignored = write(fd, &one, sizeof(one));
      (void)ignored;
    }
    errno = saved_errno;
    if (p != MAP_FAILED) return;
    break;  // cannot repair: die as we would have
  }
  // Not client memory: a daemon bug. Hand it to whoever handled SIGBUS before,
  // or die of it (the access re-faults with the default action restored).
  if ((g_previous.sa_flags & SA_SIGINFO) != 0 && g_previous.sa_sigaction != nullptr) {
    g_previous.sa_sigaction(sig, info, ucontext);
    return;
  }
  if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN &&
      g_previous.sa_handler != nullptr) {
    g_previous.sa_handler(sig);
    return;
  }
  signal(SIGBUS, SIG_DFL);
}

}  // namespace

Status ClientMemoryGuard::Install() {
  std::call_once(g_install_once, [] {
    const int fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (fd < 0) {
      g_install_error = std::string("eventfd: ") + std::strerror(errno);
      return;
    }
    g_event_fd.store(fd);
    struct sigaction sa {};
    sa.sa_sigaction = OnSigbus;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGBUS, &sa, &g_previous) != 0)
      g_install_error = std::string("sigaction(SIGBUS): ") + std::strerror(errno);
  });
  if (g_install_error.empty()) return Status::Ok();
  return Status(StatusCode::kInternal, g_install_error);
}

int ClientMemoryGuard::Register(void* base, size_t bytes, uint64_t owner) {
  for (size_t i = 0; i < kMaxRanges; ++i) {
    Range& r = g_ranges[i];
    uint32_t expected = kFree;
    if (!r.state.compare_exchange_strong(expected, kClaimed, std::memory_order_acq_rel)) continue;
    r.begin.store(reinterpret_cast<uintptr_t>(base), std::memory_order_relaxed);
    r.end.store(reinterpret_cast<uintptr_t>(base) + bytes, std::memory_order_relaxed);
    r.owner.store(owner, std::memory_order_relaxed);
    size_t high = g_high.load(std::memory_order_relaxed);
    while (high < i + 1 && !g_high.compare_exchange_weak(high, i + 1, std::memory_order_acq_rel)) {
    }
    r.state.store(kActive, std::memory_order_release);
    return static_cast<int>(i);
  }
  return -1;
}

void ClientMemoryGuard::Unregister(int handle) {
  if (handle < 0 || static_cast<size_t>(handle) >= kMaxRanges) return;
  Range& r = g_ranges[handle];
  r.begin.store(0, std::memory_order_relaxed);
  r.end.store(0, std::memory_order_relaxed);
  r.state.store(kFree, std::memory_order_release);
}

void ClientMemoryGuard::SetOwner(int handle, uint64_t owner) {
  if (handle < 0 || static_cast<size_t>(handle) >= kMaxRanges) return;
  g_ranges[handle].owner.store(owner, std::memory_order_relaxed);
}

bool ClientMemoryGuard::Faulted(int handle) {
  if (handle < 0 || static_cast<size_t>(handle) >= kMaxRanges) return false;
  const uint32_t st = g_ranges[handle].state.load(std::memory_order_acquire);
  return st == kFaulted || st == kReported;
}

int ClientMemoryGuard::FaultEventFd() { return g_event_fd.load(); }

std::vector<uint64_t> ClientMemoryGuard::TakeFaults() {
  const int fd = g_event_fd.load();
  if (fd >= 0) {
    uint64_t v;
    ssize_t ignored = read(fd, &v, sizeof(v));
    (void)ignored;
  }
  std::vector<uint64_t> owners;
  const size_t high = g_high.load(std::memory_order_acquire);
  for (size_t i = 0; i < high; ++i) {
    uint32_t expected = kFaulted;
    if (g_ranges[i].state.compare_exchange_strong(expected, kReported, std::memory_order_acq_rel))
      owners.push_back(g_ranges[i].owner.load(std::memory_order_relaxed));
  }
  return owners;
}

}  // namespace trainstream::daemon
