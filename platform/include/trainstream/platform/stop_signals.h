// The platform seam for the requests that stop or restart the daemon, and the
// wait of its main loop. Two sides, picked by platform/CMakeLists.txt
// (docs/windows.md):
//   stop_signals_linux.cc    SIGTERM, SIGINT, SIGHUP and SIGUSR2 blocked in
//                            every thread and read from a signalfd; Wake() and
//                            Deliver() write an eventfd; Wait() polls both
//   stop_signals_windows.cc  a console Ctrl handler (Ctrl-C, Ctrl-Break, the
//                            console closing, logoff, shutdown) and Deliver()
//                            (the service control handler's stop and shutdown,
//                            platform/service.h) queue a request and set an
//                            event; Wait() waits on that event
//
// Note [No code in signal handlers]: neither side runs the daemon's code where
// a signal arrives. On Linux the signals never run a handler at all (they are
// blocked and read from the signalfd); on Windows the Ctrl handler and the
// service control handler, which run on threads the system makes, only queue
// the request and set the event. The main loop, on its own thread, takes it
// from Wait() and runs the shutdown there, as it did with the signalfd.
#pragma once

#include <memory>
#include <string>

namespace trainstream::platform {

// What a request asks for. The daemon maps each to what SIGTERM and the others
// meant before the seam (daemon.cc).
enum class StopKind {
  kNone,       // Wait() timed out or was woken: nothing to stop
  kTerminate,  // SIGTERM; a service stop; Ctrl-Break, the console closing
  kInterrupt,  // SIGINT; Ctrl-C
  kShutdown,   // the system is shutting down (Windows: a service's
               // SERVICE_CONTROL_SHUTDOWN, a console's CTRL_SHUTDOWN_EVENT);
               // Linux sends SIGTERM for that, so it never arrives there
  kReload,     // SIGHUP; nothing on Windows sends it
  kRestart,    // SIGUSR2 (systemd's RestartKillSignal; daemon.cc's Note [A
               // restart keeps the optimizer state]); nothing on Windows sends it
};

struct StopRequest {
  StopKind kind = StopKind::kNone;
  // For the log: "signal Terminated" (strsignal's words) on Linux, "service
  // stop", "Ctrl-C" and so on on Windows, or what Deliver() was given.
  std::string description;
};

// The one receiver of stop requests in a process: the signal mask and the
// console Ctrl handler are process-wide, so at most one exists at a time.
class StopSignals {
 public:
  // Starts receiving. Call it before the process starts any other thread: on
  // Linux it blocks the signals above in the calling thread, so that every
  // thread started later inherits the mask and none of them runs the default
  // action (it also ignores SIGPIPE). Returns 0, EBUSY when one already exists,
  // or an errno value (Linux) / GetLastError() value (Windows) from the call
  // that failed.
  static int Create(std::unique_ptr<StopSignals>* out);
  // Stops receiving. The signals stay blocked on Linux (threads that inherited
  // the mask keep it); on Windows the Ctrl handler is removed.
  ~StopSignals();
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

  // Waits up to `timeout_ms` (negative: no limit) for a request and returns
  // the oldest one not yet returned; kNone when the time ran out or Wake() was
  // called. Only one thread may wait at a time (the main loop).
  StopRequest Wait(int timeout_ms);
  // Ends the current Wait() early, or the next one when none is waiting. Safe
  // from any thread, and cheap (an RPC handler calls it).
  void Wake();
  // Queues `request` as if it had arrived from the system, and wakes Wait().
  // Safe from any thread. The Windows service control handler uses it for stop
  // and shutdown; tests use it on both sides.
  void Deliver(StopRequest request);

 private:
  struct Impl;
  explicit StopSignals(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace trainstream::platform
