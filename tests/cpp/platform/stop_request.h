// Sends this process the system's own stop request, for the stop seam's test
// (stop_signals_test.cc). One source file per system, as the seam has:
//   stop_request_linux.cc    kill(getpid(), SIGTERM)
//   stop_request_windows.cc  GenerateConsoleCtrlEvent(CTRL_BREAK_EVENT) to the
//                            process group of this process
#pragma once

#include <string>

namespace trainstream::platform::testing {

// Sends it. Returns false with `why` set when it cannot be sent (Windows: the
// process has no console). `*description` is what StopSignals::Wait must
// report for it; it maps to StopKind::kTerminate on both systems.
bool SendTerminate(std::string* description, std::string* why);

}  // namespace trainstream::platform::testing
