#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "child_process.h"

namespace trainstream::platform::testing {

ChildProcess::ChildProcess() {
  const pid_t pid = fork();
  if (pid == 0) {
    for (;;) pause();  // until killed
  }
  pid_ = pid > 0 ? pid : 0;
}

ChildProcess::~ChildProcess() {
  if (pid_ == 0) return;
  Kill();
  int status = 0;
  waitpid(static_cast<pid_t>(pid_), &status, 0);
}

void ChildProcess::Kill() { kill(static_cast<pid_t>(pid_), SIGKILL); }

// Above /proc/sys/kernel/pid_max's limit (2^22), so never a process.
int64_t UnusedPid() { return (int64_t{1} << 22) + 1; }

}  // namespace trainstream::platform::testing
