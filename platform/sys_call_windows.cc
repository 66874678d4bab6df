// The Windows side of the system-call seam (trainstream/platform/sys_call.h):
// strerror_s, the C runtime's text for its errno values, which this seam's
// Windows files return after translating GetLastError() (windows_common.h).
#include <string.h>

#include <string>

#include "trainstream/platform/sys_call.h"

namespace trainstream::platform {

std::string ErrnoMessage(int err) {
  char buffer[256];
  buffer[0] = '\0';
  if (strerror_s(buffer, sizeof buffer, err) != 0 || buffer[0] == '\0') {
    return "Unknown error " + std::to_string(err);
  }
  return buffer;
}

}  // namespace trainstream::platform
