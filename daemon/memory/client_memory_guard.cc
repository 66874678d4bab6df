#include "memory/client_memory_guard.h"

#include <atomic>
#include <cerrno>
#include <cstring>
#include <memory>
#include <mutex>

#include "trainstream/platform/mapping_faults.h"
#include "trainstream/platform/sys_call.h"

namespace trainstream::daemon {
namespace {

// A range's life: kFree -> kClaimed (being filled in) -> kActive -> kFaulted
// -> kReported (TakeFaults returned it) -> kFree (Unregister).
enum : uint32_t { kFree = 0, kClaimed, kActive, kFaulted, kReported };

// Read by the fault handler (a signal handler on Linux), so only lock-free atomics (no allocation,
// no locks).
struct Range {
  std::atomic<uint32_t> state{kFree};
  std::atomic<uintptr_t> begin{0};
  std::atomic<uintptr_t> end{0};
  std::atomic<uint64_t> owner{0};
};
static_assert(std::atomic<uintptr_t>::is_always_lock_free, "used in a signal handler");

Range g_ranges[ClientMemoryGuard::kMaxRanges];
std::atomic<size_t> g_high{0};  // ranges [0, g_high) may be in use
// Set by the fault handler: the session layer's reaper wakes on it.
std::unique_ptr<platform::WakeEvent> g_fault_event;
std::once_flag g_install_once;
std::string g_install_error;

// The seam's fault handler (platform/mapping_faults.h): true when `addr` is in
// a guarded range, which it then replaced with zero pages.
bool OnMappingFault(uintptr_t addr) {
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
    const bool replaced = platform::ReplaceWithZeroPages(b, e - b);
    uint32_t expected = kActive;
    r.state.compare_exchange_strong(expected, kFaulted, std::memory_order_acq_rel);
    if (g_fault_event) g_fault_event->Set();
    return replaced;  // cannot repair: die as we would have
  }
  return false;
}

}  // namespace

Status ClientMemoryGuard::Install() {
  std::call_once(g_install_once, [] {
    if (int err = platform::WakeEvent::Create(&g_fault_event); err != 0) {
      g_install_error = platform::ErrnoText("cannot create the fault wake-up", err);
      return;
    }
    std::string why;
    if (platform::InstallMappingFaultHandler(OnMappingFault, &why) != 0) g_install_error = why;
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

platform::WakeEvent* ClientMemoryGuard::FaultEvent() { return g_fault_event.get(); }

std::vector<uint64_t> ClientMemoryGuard::TakeFaults() {
  if (g_fault_event) g_fault_event->Clear();
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
