// Daemon: ties trainstreamd together and runs it until a signal, a Shutdown
// RPC, the end of a drain, or the idle timeout.
#pragma once

#include "config.h"

namespace trainstream::daemon {

// Runs the daemon with `config` (already merged from file and flags). The
// caller must have blocked SIGTERM/SIGINT/SIGHUP in every thread (signal_fd is a
// signalfd for them). `ready` is called once the socket accepts connections (or
// with an error message when startup fails). Returns the process exit code.
int RunDaemon(const DaemonConfig& config, int signal_fd, void (*ready)(const char* error));

}  // namespace trainstream::daemon
