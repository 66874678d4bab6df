// The Linux side of the endpoint seam (trainstream/platform/endpoint.h):
// a mode-0600 file renamed into place.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <string>

#include "endpoint_system.h"

namespace trainstream::platform::internal {

int ReplaceWithOwnerOnlyFile(const std::string& path, const std::string& contents) {
  const std::string temp = path + ".new." + std::to_string(getpid());
  unlink(temp.c_str());  // a leftover of a crashed writer with this pid
  const int fd = open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) return errno;
  int err = fchmod(fd, 0600) == 0 ? 0 : errno;  // whatever the umask took away
  for (size_t done = 0; err == 0 && done < contents.size();) {
    const ssize_t n = write(fd, contents.data() + done, contents.size() - done);
    if (n < 0 && errno != EINTR) err = errno;
    if (n > 0) done += static_cast<size_t>(n);
  }
  if (close(fd) != 0 && err == 0) err = errno;
  if (err == 0 && rename(temp.c_str(), path.c_str()) != 0) err = errno;
  if (err != 0) unlink(temp.c_str());
  return err;
}

}  // namespace trainstream::platform::internal
