// The Linux side of the service seam (trainstream/platform/service.h): there is
// none. systemd runs the daemon as it is, with the unit in deploy/, and stops
// it with SIGTERM (platform/stop_signals.h). Every call fails and says so.
#include <utility>

#include "trainstream/platform/service.h"

namespace trainstream::platform {
namespace {

const char kNoServices[] =
    "Windows services exist only on Windows; on Linux, systemd runs trainstreamd with "
    "deploy/trainstreamd.service";

}  // namespace

bool HasServices() { return false; }

bool InstallService(const ServiceDefinition& /*definition*/, std::string* error) {
  *error = kNoServices;
  return false;
}

bool UninstallService(const std::string& /*name*/, bool* /*still_running*/, std::string* error) {
  *error = kNoServices;
  return false;
}

int RunAsService(const std::string& /*name*/, std::function<void(StopRequest)> /*on_stop*/,
                 std::function<int(ServiceReporter* reporter)> /*run*/, std::string* error) {
  *error = kNoServices;
  return -1;
}

}  // namespace trainstream::platform
