// The platform seam for running the daemon as the system's service. Two
// sides, picked by platform/CMakeLists.txt (docs/windows.md):
//   service_windows.cc  a Windows service: installed in the service control
//                       manager (SCM), started by it, reporting its state to
//                       it, stopped by it (Note [The daemon as a Windows
//                       service], service_windows.cc)
//   service_linux.cc    none of it: on Linux systemd runs the daemon as it is
//                       (deploy/trainstreamd.service), so every call fails and
//                       says so
//
// What a service stop means is the caller's: RunAsService hands the SCM's stop
// and shutdown controls to `on_stop`, which the daemon gives to its
// StopSignals (platform/stop_signals.h), so a service stop runs the same
// shutdown as SIGTERM does on Linux.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "trainstream/platform/stop_signals.h"

namespace trainstream::platform {

// True where the daemon can be installed and run as a service through this
// seam (Windows); false on Linux.
bool HasServices();

struct ServiceDefinition {
  // The service's key name in the SCM: 1 to 256 characters, none of them '/'
  // or '\' (the SCM's rule).
  std::string name;
  std::string display_name;  // as the Services console shows it; empty: `name`
  std::string description;   // one line for the Services console; may be empty
  // The program the SCM starts; empty: the program that calls InstallService.
  // An absolute path.
  std::string program;
  // Its arguments (each quoted for the command line as needed). They must make
  // the program call RunAsService (the daemon's --service flag).
  std::vector<std::string> arguments;
  // Started when the system starts (SERVICE_AUTO_START), else on demand.
  bool start_with_system = true;
};

// Registers `definition` with the SCM, running as LocalSystem. Needs an
// administrator. False, with `error` set to a message naming the service and
// the cause (it exists already, access denied, a bad name), when it fails.
bool InstallService(const ServiceDefinition& definition, std::string* error);

// Removes service `name` from the SCM. A running service is removed once it
// stops; then `*still_running` (if given) is set to true. False, with `error`
// set, when it cannot be removed (no such service, access denied).
bool UninstallService(const std::string& name, bool* still_running, std::string* error);

// What RunAsService hands to the code it runs.
class ServiceReporter {
 public:
  virtual ~ServiceReporter() = default;
  // The service is ready (the daemon serves its socket): the SCM shows it
  // running and lets it be stopped. Call it once; before it, the SCM shows it
  // starting.
  virtual void ReportRunning() = 0;
};

// Runs `run` as the service `name` in a process the SCM started, and returns
// its exit code once the SCM has been told that the service stopped (a nonzero
// code is reported as a service-specific error). The SCM's stop and shutdown
// controls call `on_stop` on the SCM's own thread with kTerminate ("service
// stop") or kShutdown ("system shutdown"): it must only hand the request on
// (StopSignals::Deliver). Returns -1 with `error` set when the process was not
// started by the SCM (run from a console: use `sc start`), or on Linux.
int RunAsService(const std::string& name, std::function<void(StopRequest)> on_stop,
                 std::function<int(ServiceReporter* reporter)> run, std::string* error);

}  // namespace trainstream::platform
