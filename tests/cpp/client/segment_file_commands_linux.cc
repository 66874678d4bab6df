// The Linux side of segment_file_commands.h: open, ftruncate, chmod.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <string>

#include "segment_file_commands.h"

int RunSegmentFileCommand(const std::string& command, const std::string& path,
                          const std::string& arg) {
  if (command == "try_chmod") {
    return chmod(path.c_str(), static_cast<mode_t>(std::stoul(arg, nullptr, 8))) == 0 ? 0 : errno;
  }
  const int flags = command == "truncate" || arg == "rw" ? O_RDWR : O_RDONLY;
  const int fd = open(path.c_str(), flags | O_CLOEXEC);
  if (fd < 0) return errno;
  int err = 0;
  if (command == "truncate" && ftruncate(fd, static_cast<off_t>(std::stoull(arg))) != 0)
    err = errno;
  close(fd);
  return err;
}
