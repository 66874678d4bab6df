// The platform seam for client liveness: ProcessWatcher calls back when a
// watched process exits, so a killed client's memory is reclaimed within
// milliseconds even when gRPC is slow to notice the closed connection. One
// watcher serves every session. Two sides, picked by
// platform/CMakeLists.txt (docs/windows.md):
//   process_watcher_linux.cc    pidfd_open + poll, woken by an eventfd
//   process_watcher_windows.cc  a process handle (SYNCHRONIZE) per watch, waited
//                               on by the system thread pool
#pragma once

#include <cstdint>
#include <functional>
#include <memory>

namespace trainstream::platform {

class ProcessWatcher {
 public:
  // `on_exit(key)` runs on the watcher's own thread, with no lock of the
  // watcher held (it may call Unwatch), once per Watch whose process exited.
  explicit ProcessWatcher(std::function<void(uint64_t key)> on_exit);
  // Stops the thread; no on_exit runs after it returns.
  ~ProcessWatcher();
  ProcessWatcher(const ProcessWatcher&) = delete;
  ProcessWatcher& operator=(const ProcessWatcher&) = delete;

  // Watches process `pid` under `key`, replacing an earlier watch of `key`.
  // A process that already exited but is not yet reaped counts as exited
  // (on_exit follows at once). False when no such process exists or it cannot
  // be watched (errno on Linux, GetLastError() on Windows, says which).
  bool Watch(uint64_t key, int64_t pid);
  // Ends the watch of `key`, if any. After it returns, on_exit(key) does not
  // run for that watch unless it was already running.
  void Unwatch(uint64_t key);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// A number that, with the pid, names one process for good: a pid reused later
// has another (Note [Optimizer state outlives the daemon] keeps it with a
// state's owner). Linux: the start time in clock ticks since boot (field 22 of
// /proc/<pid>/stat). Windows: the creation time (100 ns since 1601). 0 when
// there is no such process or it has exited (a Linux zombie; a Windows process
// that ended while someone still holds its handle).
uint64_t ProcessStartTime(int64_t pid);

// The client process a session belongs to. Linux: `kernel_pid`, what
// SO_PEERCRED said, always. Windows, where no kernel names the peer
// (kernel_pid 0; platform/socket_peer.h): `stated_pid`, the pid the client gave
// in Attach, when that process runs and runs as this process's user (its
// token's user SID), so a client cannot tie its session to another user's
// process; else 0.
int64_t SessionProcess(int64_t kernel_pid, int64_t stated_pid);

}  // namespace trainstream::platform
