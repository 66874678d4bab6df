// The platform seam for a failed system call's words: an errno value becomes
// text, and text a Status, here and nowhere else. Every call in this seam
// returns 0 or an errno value (shm.h, files.h, ...), and the daemon and the
// client name what failed ("cannot create segment <path>") and let this header
// say why ("No space left on device"), so a message reads the same wherever
// the call was made. Two sides for the system's text, picked by
// platform/CMakeLists.txt: sys_call_linux.cc (strerror_r) and
// sys_call_windows.cc (strerror_s, the C runtime's errno text); the rest is
// sys_call.cc, shared. Thread-safe throughout: strerror itself is not (it may
// return one static buffer), which is why no other file calls it.
#pragma once

#include <string>
#include <string_view>

#include "trainstream/status.h"

namespace trainstream::platform {

// The system's text for the errno value `err`, e.g. "No such file or
// directory". A number the system does not know reads as the system words it
// ("Unknown error 1234" on Linux). Never empty.
std::string ErrnoMessage(int err);

// "<what>: <ErrnoMessage(err)>", the one form of such a message. `what` names
// the call or the object ("cannot open /x", "mmap /dev/shm/y").
std::string ErrnoText(std::string_view what, int err);

// Status(code, ErrnoText(what, err)). The caller picks the code: the same errno
// can be a caller's mistake (ENOENT for a path it named) or the daemon's.
Status ErrnoStatus(StatusCode code, std::string_view what, int err);

}  // namespace trainstream::platform
