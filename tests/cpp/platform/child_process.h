// A child process for the liveness seam's test (process_watcher_test.cc): it
// starts, stays until Kill, and is reaped on destruction. One source file per
// system (child_process_linux.cc, child_process_windows.cc), as the seam has.
#pragma once

#include <cstdint>

namespace trainstream::platform::testing {

class ChildProcess {
 public:
  // Starts the child; pid() is 0 when that failed.
  ChildProcess();
  // Kills the child if it still runs, and reaps it.
  ~ChildProcess();
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  int64_t pid() const { return pid_; }
  // Kills the child the way a SIGKILL or TerminateProcess ends a client: it
  // runs no code of its own on the way out. Does not reap it.
  void Kill();

 private:
  int64_t pid_ = 0;
  void* handle_ = nullptr;  // Windows: the process handle
};

// A process id no process has (the test's "already gone" client).
int64_t UnusedPid();

}  // namespace trainstream::platform::testing
