// The Linux side of the system-call seam (trainstream/platform/sys_call.h):
// strerror_r, which writes into the caller's buffer where strerror may share
// one between threads.
#include <string.h>

#include <string>

#include "trainstream/platform/sys_call.h"

namespace trainstream::platform {
namespace {

// strerror_r comes in two forms, picked by the feature macros: the GNU one
// returns the text (which may be a static string, not `buffer`), the POSIX one
// returns 0 or an error and fills `buffer`. Overloading on the return type
// takes whichever this C library declares.
[[maybe_unused]] const char* TextOf(const char* gnu_result, const char* /*buffer*/) {
  return gnu_result;
}
[[maybe_unused]] const char* TextOf(int posix_result, const char* buffer) {
  return posix_result == 0 ? buffer : nullptr;
}

}  // namespace

std::string ErrnoMessage(int err) {
  char buffer[256];
  buffer[0] = '\0';
  const char* text = TextOf(strerror_r(err, buffer, sizeof buffer), buffer);
  if (text == nullptr || text[0] == '\0') return "Unknown error " + std::to_string(err);
  return text;
}

}  // namespace trainstream::platform
