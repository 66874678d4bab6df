// DaemonState: the few daemon-wide facts the RPC handlers read and the main
// loop acts on. All members are atomics or immutable after startup.
#pragma once

#include <sys/eventfd.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>

namespace trainstream::daemon {

struct DaemonState {
  std::chrono::steady_clock::time_point started = std::chrono::steady_clock::now();
  std::string socket_path;
  unsigned worker_threads = 0;
  std::atomic<bool> draining{false};
  std::atomic<bool> shutting_down{false};
  // A Shutdown RPC asked the main loop to stop (now or after draining).
  std::atomic<bool> shutdown_requested{false};
  // steady_clock nanoseconds of the last RPC (idle exit).
  std::atomic<int64_t> last_activity_ns{0};
  int wake_fd = -1;  // eventfd the main loop polls; written to wake it

  void Touch() {
    last_activity_ns.store(std::chrono::steady_clock::now().time_since_epoch().count());
  }
  void WakeMainLoop() {
    uint64_t one = 1;
    ssize_t ignored = write(wake_fd, &one, sizeof(one));
    (void)ignored;
  }
  double uptime_s() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  }
};

}  // namespace trainstream::daemon
