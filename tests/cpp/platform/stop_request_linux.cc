#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "stop_request.h"
#include "trainstream/platform/sys_call.h"

namespace trainstream::platform::testing {

bool SendTerminate(std::string* description, std::string* why) {
  *description = std::string("signal ") + strsignal(SIGTERM);
  if (kill(getpid(), SIGTERM) != 0) {
    *why = ErrnoText("kill", errno);
    return false;
  }
  return true;
}

}  // namespace trainstream::platform::testing
