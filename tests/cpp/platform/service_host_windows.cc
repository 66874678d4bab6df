// platform_service_host.exe NAME MARKER: a service for the service seam's test
// (service_windows_test.cc), run the way trainstreamd.exe --service runs: it
// hands the SCM's stop to its StopSignals, reports running, and waits on them
// as the daemon's main loop does. It appends what it did to the file MARKER:
// "running", then "stopped: <description>" when a stop arrived.
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>

#include "trainstream/platform/service.h"
#include "trainstream/platform/stop_signals.h"

using namespace trainstream::platform;

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: platform_service_host NAME MARKER\n");
    return 2;
  }
  const std::string name = argv[1], marker = argv[2];
  std::unique_ptr<StopSignals> stop;
  if (int err = StopSignals::Create(&stop); err != 0) {
    std::fprintf(stderr, "platform_service_host: StopSignals::Create: %d\n", err);
    return 1;
  }
  std::string error;
  const int code = RunAsService(
      name, [&](StopRequest request) { stop->Deliver(std::move(request)); },
      [&](ServiceReporter* reporter) {
        reporter->ReportRunning();
        std::ofstream(marker, std::ios::app) << "running\n";
        StopRequest request;
        while (request.kind == StopKind::kNone) request = stop->Wait(-1);
        std::ofstream(marker, std::ios::app) << "stopped: " << request.description << "\n";
        return 0;
      },
      &error);
  if (code < 0) {
    std::fprintf(stderr, "platform_service_host: %s\n", error.c_str());
    return 2;
  }
  return code;
}
