// The Linux side of trainstream/platform/files.h: readdir + lstat, and
// O_NOFOLLOW | O_NONBLOCK opens (a client may plant a symlink or a FIFO in a
// shared folder like /dev/shm).
#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <string>
#include <vector>

#include "trainstream/platform/files.h"

namespace trainstream::platform {
namespace {

FileKind KindOf(mode_t mode) {
  if (S_ISREG(mode)) return FileKind::kRegular;
  if (S_ISDIR(mode)) return FileKind::kDirectory;
  if (S_ISLNK(mode)) return FileKind::kLink;
  return FileKind::kOther;
}

// Opens the regular file at `path` without following a link or blocking on a
// special file. Returns the descriptor, or -errno.
int OpenRegular(const std::string& path, int flags) {
  const int fd = open(path.c_str(), flags | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) return -errno;
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    close(fd);
    return -err;
  }
  if (!S_ISREG(st.st_mode)) {
    close(fd);
    return -EINVAL;
  }
  return fd;
}

}  // namespace

int ListDirectory(const std::string& dir, std::vector<DirectoryEntry>* out) {
  out->clear();
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return errno;
  errno = 0;
  while (dirent* e = readdir(d)) {
    const std::string name = e->d_name;
    if (name == "." || name == "..") continue;
    struct stat st {};
    // Gone between readdir and lstat: not listed.
    if (lstat((dir + "/" + name).c_str(), &st) != 0) continue;
    DirectoryEntry entry{name, KindOf(st.st_mode), 0};
    if (entry.kind == FileKind::kRegular) entry.size = static_cast<uint64_t>(st.st_size);
    out->push_back(std::move(entry));
    errno = 0;
  }
  const int err = errno;
  closedir(d);
  return err;
}

int ReadFilePrefix(const std::string& path, size_t max_bytes, std::string* out) {
  out->clear();
  const int fd = OpenRegular(path, O_RDONLY);
  if (fd < 0) return -fd;
  out->resize(max_bytes);
  size_t done = 0;
  int err = 0;
  while (done < max_bytes) {
    const ssize_t n = pread(fd, out->data() + done, max_bytes - done, static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) err = errno;
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
  close(fd);
  out->resize(done);
  return err;
}

int OverwriteFile(const std::string& path, const std::string& text) {
  const int fd = OpenRegular(path, O_RDWR);
  if (fd < 0) return -fd;
  int err = ftruncate(fd, 0) == 0 ? 0 : errno;
  for (size_t done = 0; err == 0 && done < text.size();) {
    const ssize_t n = pwrite(fd, text.data() + done, text.size() - done, static_cast<off_t>(done));
    if (n < 0 && errno != EINTR) err = errno;
    if (n > 0) done += static_cast<size_t>(n);
  }
  if (close(fd) != 0 && err == 0) err = errno;
  return err;
}

int CheckWritableDirectory(const std::string& dir) {
  struct stat st {};
  if (stat(dir.c_str(), &st) != 0) return errno;
  if (!S_ISDIR(st.st_mode)) return ENOTDIR;
  return access(dir.c_str(), W_OK | X_OK) == 0 ? 0 : errno;
}

int RemoveFile(const std::string& path) { return unlink(path.c_str()) == 0 ? 0 : errno; }

int MakeDirectories(const std::string& dir) {
  for (size_t pos = 1; pos != std::string::npos; ++pos) {
    pos = dir.find('/', pos);
    const std::string part = dir.substr(0, pos);
    if (mkdir(part.c_str(), 0755) != 0 && errno != EEXIST) return errno;
    if (pos == std::string::npos) break;
  }
  return 0;
}

int LockFile(const std::string& path, intptr_t* handle) {
  const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) return errno;
  if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    close(fd);
    return err;
  }
  *handle = fd;
  return 0;
}

void UnlockFile(intptr_t handle) { close(static_cast<int>(handle)); }

}  // namespace trainstream::platform
