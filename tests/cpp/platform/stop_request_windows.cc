#include <windows.h>

#include "stop_request.h"

namespace trainstream::platform::testing {

// Group 0: every process that shares this one's console. A test whose output
// goes to a file may have none (wine64 from a script): it gets one of its own.
bool SendTerminate(std::string* description, std::string* why) {
  *description = "Ctrl-Break";
  if (!GenerateConsoleCtrlEvent(CTRL_BREAK_EVENT, 0) &&
      (!AllocConsole() || !GenerateConsoleCtrlEvent(CTRL_BREAK_EVENT, 0))) {
    *why = "GenerateConsoleCtrlEvent: error " + std::to_string(GetLastError()) +
           " (AllocConsole tried)";
    return false;
  }
  return true;
}

}  // namespace trainstream::platform::testing
