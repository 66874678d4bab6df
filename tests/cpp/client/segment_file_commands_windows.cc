// The Windows side of segment_file_commands.h: the C runtime's _wopen,
// _chsize_s and _wchmod, which report errno as the Linux calls do (a mapped
// segment cannot shrink: Note [A mapped segment cannot shrink on Windows]).
#include <fcntl.h>
#include <io.h>
#include <sys/stat.h>

#include <cerrno>
#include <filesystem>
#include <string>

#include "segment_file_commands.h"

int RunSegmentFileCommand(const std::string& command, const std::string& path,
                          const std::string& arg) {
  const std::wstring wide = std::filesystem::u8path(path).wstring();
  if (command == "try_chmod") {
    const unsigned long mode = std::stoul(arg, nullptr, 8);
    const int pmode = (mode & 0200) != 0 ? (_S_IREAD | _S_IWRITE) : _S_IREAD;
    return _wchmod(wide.c_str(), pmode) == 0 ? 0 : errno;
  }
  const int flags = (command == "truncate" || arg == "rw" ? _O_RDWR : _O_RDONLY) | _O_BINARY;
  const int fd = _wopen(wide.c_str(), flags);
  if (fd < 0) return errno;
  const int err = command == "truncate" ? _chsize_s(fd, std::stoll(arg)) : 0;
  _close(fd);
  return err;
}
