#include <windows.h>

#include "child_process.h"

namespace trainstream::platform::testing {

// The test's own executable, started suspended: it never runs a line, so it
// needs no program or arguments of its own and stays until terminated.
ChildProcess::ChildProcess() {
  wchar_t path[MAX_PATH];
  if (GetModuleFileNameW(nullptr, path, MAX_PATH) == 0) return;
  STARTUPINFOW startup{};
  startup.cb = sizeof(startup);
  PROCESS_INFORMATION info{};
  if (!CreateProcessW(path, nullptr, nullptr, nullptr, FALSE, CREATE_SUSPENDED, nullptr, nullptr,
                      &startup, &info)) {
    return;
  }
  CloseHandle(info.hThread);
  handle_ = info.hProcess;
  pid_ = info.dwProcessId;
}

ChildProcess::~ChildProcess() {
  if (handle_ == nullptr) return;
  Kill();
  WaitForSingleObject(handle_, INFINITE);
  CloseHandle(handle_);
}

void ChildProcess::Kill() { TerminateProcess(handle_, 137); }

// Windows process ids are multiples of 4, so this one is never a process.
int64_t UnusedPid() { return 0x7ffffffd; }

}  // namespace trainstream::platform::testing
