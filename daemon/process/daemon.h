// Daemon: ties trainstreamd together and runs it until a signal, a Shutdown
// RPC, the end of a drain, or the idle timeout.
#pragma once

#include <functional>

#include "process/config.h"
#include "trainstream/platform/stop_signals.h"

namespace trainstream::daemon {

// Runs the daemon with `config` (already merged from file and flags) until a
// stop request arrives through `stop_signals` (made before any thread started:
// StopSignals::Create), a Shutdown RPC, the end of a drain, or the idle
// timeout. `stop_signals` must outlive the call. `ready` is called once the
// socket accepts connections (or with an error message when startup fails):
// the background parent's pipe on Linux, the SCM's "running" for a Windows
// service (platform/service.h).
// Returns the process exit code.
int RunDaemon(const DaemonConfig& config, platform::StopSignals* stop_signals,
              const std::function<void(const char* error)>& ready);

}  // namespace trainstream::daemon
