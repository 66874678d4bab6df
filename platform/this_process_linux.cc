// The Linux side of trainstream/platform/this_process.h.
#include <limits.h>
#include <unistd.h>

#include <cerrno>
#include <string>

#include "trainstream/platform/this_process.h"

namespace trainstream::platform {

int64_t CurrentProcessId() { return static_cast<int64_t>(getpid()); }

int CurrentExecutablePath(std::string* out) {
  char self[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n <= 0) return n < 0 ? errno : ENOENT;
  out->assign(self, static_cast<size_t>(n));
  return 0;
}

std::string ProgramFileName(const std::string& name) { return name; }

bool MayExecute(const std::string& path) { return access(path.c_str(), X_OK) == 0; }

bool StderrIsTerminal() { return isatty(STDERR_FILENO) != 0; }

}  // namespace trainstream::platform
