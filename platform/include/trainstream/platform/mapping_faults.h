// The platform seam for a mapped file that shrinks under the daemon (Note
// [Client pages can vanish], daemon/memory/client_memory_guard.h), and the
// wake-up a fault handler may send.
//
// Linux: an access past the new end of a shrunk file raises SIGBUS. The seam
// installs one SIGBUS handler that asks the daemon's handler whether the
// address is client memory it repaired (by ReplaceWithZeroPages); any other
// fault goes to the handler installed before, or kills the process as SIGBUS
// would. Windows: a file cannot shrink below a mapped view, whoever asks (Note
// [A mapped segment cannot shrink on Windows], shm_windows.cc), so there is no
// such fault: installing succeeds, the handler is never called, and
// ReplaceWithZeroPages is never needed (it fails).
//
// Two sides, picked by platform/CMakeLists.txt: mapping_faults_linux.cc
// (sigaction, mmap MAP_FIXED, eventfd + poll) and mapping_faults_windows.cc
// (an event, WaitForMultipleObjects).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace trainstream::platform {

// Runs inside the fault (a signal handler on Linux): async-signal-safe code
// only. Returns true when it repaired `address` (the access then retries).
using MappingFaultHandler = bool (*)(uintptr_t address);

// Installs `handler` once per process; a second call does nothing and answers
// the first's result. 0, or an errno value with `*error` saying what failed.
int InstallMappingFaultHandler(MappingFaultHandler handler, std::string* error);

// Replaces the mapping at [begin, begin + bytes) with private zero pages
// nobody else sees; async-signal-safe. False when it cannot (then the fault is
// not repaired).
bool ReplaceWithZeroPages(uintptr_t begin, size_t bytes);

// A wake-up that a thread, or a fault handler, sets and another thread waits
// for, possibly together with a second one.
class WakeEvent {
 public:
  ~WakeEvent();
  WakeEvent(const WakeEvent&) = delete;
  WakeEvent& operator=(const WakeEvent&) = delete;

  // 0 or an errno value.
  static int Create(std::unique_ptr<WakeEvent>* out);

  // Sets the event; async-signal-safe. Sets that come before a Clear merge.
  void Set();
  // Unsets it (a waiter calls this once awake, before looking at its work).
  void Clear();

  // Waits until `a` or `b` (null: `a` alone) is set; returns without
  // clearing either. 0, or an errno value (EINTR is retried).
  static int WaitEither(WakeEvent* a, WakeEvent* b);

 private:
  WakeEvent();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace trainstream::platform
