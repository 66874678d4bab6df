// What both sides of the system-call seam share (trainstream/platform/sys_call.h):
// the form of a message; the system's text is sys_call_linux.cc's or
// sys_call_windows.cc's.
#include "trainstream/platform/sys_call.h"

#include <string>
#include <string_view>

namespace trainstream::platform {

std::string ErrnoText(std::string_view what, int err) {
  std::string text(what);
  text += ": ";
  text += ErrnoMessage(err);
  return text;
}

Status ErrnoStatus(StatusCode code, std::string_view what, int err) {
  return Status(code, ErrnoText(what, err));
}

}  // namespace trainstream::platform
