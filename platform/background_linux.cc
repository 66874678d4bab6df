// The Linux side of trainstream/platform/background.h: fork, a pipe for the
// readiness report, setsid, and RLIMIT_NOFILE (the daemon's main.cc code,
// moved).
#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <string>

#include "trainstream/platform/background.h"
#include "trainstream/platform/sys_call.h"

namespace trainstream::platform {
namespace {

int g_ready_fd = -1;  // write end of the pipe the waiting parent reads

}  // namespace

int StartInBackground(bool* is_parent, int* exit_code, std::string* error) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) {
    const int err = errno;
    *error = ErrnoText("pipe2", err);
    return err;
  }
  const pid_t pid = fork();
  if (pid < 0) {
    const int err = errno;
    close(fds[0]);
    close(fds[1]);
    *error = ErrnoText("fork", err);
    return err;
  }
  if (pid > 0) {
    close(fds[1]);
    std::string msg;
    char buf[512];
    ssize_t n;
    while ((n = read(fds[0], buf, sizeof(buf))) > 0) msg.append(buf, static_cast<size_t>(n));
    close(fds[0]);
    if (msg == "ok") {
      *exit_code = 0;
    } else {
      std::fprintf(stderr, "trainstreamd: %s\n",
                   msg.empty() ? "exited during startup" : msg.c_str());
      *exit_code = 1;
    }
    *is_parent = true;
    return 0;
  }
  close(fds[0]);
  setsid();
  g_ready_fd = fds[1];
  *is_parent = false;
  return 0;
}

void ReportBackgroundReady(const char* error) {
  if (g_ready_fd < 0) return;
  std::string msg = error == nullptr ? std::string("ok") : std::string(error);
  ssize_t ignored = write(g_ready_fd, msg.data(), msg.size());
  (void)ignored;
  close(g_ready_fd);
  g_ready_fd = -1;
  if (error == nullptr) {
    // Detach from the terminal now that the parent has the result.
    int devnull = open("/dev/null", O_RDWR | O_CLOEXEC);
    if (devnull >= 0) {
      dup2(devnull, STDIN_FILENO);
      dup2(devnull, STDOUT_FILENO);
      dup2(devnull, STDERR_FILENO);
      close(devnull);
    }
  }
}

int RaiseOpenFileLimit(uint64_t* from, uint64_t* to) {
  rlimit lim{};
  if (getrlimit(RLIMIT_NOFILE, &lim) != 0) return errno;
  *from = static_cast<uint64_t>(lim.rlim_cur);
  *to = static_cast<uint64_t>(lim.rlim_max);
  if (lim.rlim_cur >= lim.rlim_max) return 0;
  lim.rlim_cur = lim.rlim_max;
  return setrlimit(RLIMIT_NOFILE, &lim) == 0 ? 0 : errno;
}

}  // namespace trainstream::platform
