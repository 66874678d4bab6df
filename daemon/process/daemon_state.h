// DaemonState: the few daemon-wide facts the RPC handlers read and the main
// loop acts on. All members are atomics or immutable after startup.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>

#include "trainstream/platform/stop_signals.h"

namespace trainstream::daemon {

struct DaemonState {
  std::chrono::steady_clock::time_point started = std::chrono::steady_clock::now();
  std::string socket_path;
  // What every control call must carry (platform/control_channel.h): empty
  // where the transport checks the peer's credentials (Linux); on Windows the
  // endpoint file's secret (Note [A secret in an owner-only file stands in for
  // SO_PEERCRED]). Set before the first RPC.
  std::string endpoint_secret;
  unsigned worker_threads = 0;
  std::atomic<bool> draining{false};
  std::atomic<bool> shutting_down{false};
  // A Shutdown RPC asked the main loop to stop (now or after draining).
  std::atomic<bool> shutdown_requested{false};
  // That RPC asked for a clean stop (ShutdownRequest.discard_state).
  std::atomic<bool> discard_state{false};
  // The daemon stops keeping its sessions' state for the next one (Note [A
  // restart keeps the optimizer state], daemon.cc): a session's stream that
  // closes now leaves the session as it is, for the exit to keep.
  std::atomic<bool> keeping_state{false};
  // steady_clock nanoseconds of the last RPC (idle exit).
  std::atomic<int64_t> last_activity_ns{0};
  // What the main loop waits on; Wake() ends its wait. Set before the first
  // RPC; owned by the caller of RunDaemon. Null in tests with no main loop.
  platform::StopSignals* stop_signals = nullptr;

  void Touch() {
    last_activity_ns.store(std::chrono::steady_clock::now().time_since_epoch().count());
  }
  // A no-op without a main loop (tests run the handlers alone).
  void WakeMainLoop() {
    if (stop_signals != nullptr) stop_signals->Wake();
  }
  double uptime_s() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  }
};

}  // namespace trainstream::daemon
