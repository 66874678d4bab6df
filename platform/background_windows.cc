// The Windows side of trainstream/platform/background.h: no fork, no
// descriptor limit; the background form of the daemon is a service.
#include <cerrno>
#include <cstdint>
#include <string>

#include "trainstream/platform/background.h"

namespace trainstream::platform {

int StartInBackground(bool*, int*, std::string* error) {
  *error =
      "Windows has no background mode: run `trainstreamd --foreground`, or install the daemon "
      "as a service (`trainstreamd --install-service`, then `sc start trainstreamd`)";
  return ENOTSUP;
}

void ReportBackgroundReady(const char*) {}

int RaiseOpenFileLimit(uint64_t*, uint64_t*) { return ENOTSUP; }

}  // namespace trainstream::platform
