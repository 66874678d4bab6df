// The Linux side of trainstream/platform/read_only_file.h: the calls
// daemon/base/model_sources.cc, base_fill.cc and safetensors.cc made
// themselves before (openat, fstat, pread, posix_fadvise, readdir and the
// setfsuid switch), moved here as they were.
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>

#include "trainstream/platform/read_only_file.h"

namespace trainstream::platform {

void ReadOnlyFile::Close() {
  if (handle_ != kNone) close(static_cast<int>(handle_));
  handle_ = kNone;
}

int ReadOnlyFile::Open(const ReadOnlyFile* dir, const std::string& name, ReadOnlyFile* out) {
  *out = ReadOnlyFile();
  const int dirfd = dir != nullptr ? static_cast<int>(dir->handle_) : AT_FDCWD;
  // O_NONBLOCK so that a FIFO cannot park the thread in open().
  const int fd = openat(dirfd, name.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
  if (fd < 0) return errno;
  out->handle_ = fd;
  out->path_ = name;
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    *out = ReadOnlyFile();
    return err;
  }
  ReadOnlyFileFacts& f = out->facts_;
  f.regular = S_ISREG(st.st_mode);
  f.directory = S_ISDIR(st.st_mode);
  f.size = static_cast<uint64_t>(st.st_size);
  f.dev = st.st_dev;
  f.ino = st.st_ino;
  f.mtime_ns = static_cast<uint64_t>(st.st_mtim.tv_sec) * 1000000000ull +
               static_cast<uint64_t>(st.st_mtim.tv_nsec);
  // Back to blocking reads.
  if (f.regular) fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  return 0;
}

int64_t ReadOnlyFile::ReadAt(void* dst, size_t n, uint64_t offset) const {
  return pread(static_cast<int>(handle_), dst, n, static_cast<off_t>(offset));
}

int ReadOnlyFile::CurrentSize(uint64_t* size) const {
  const off_t end = lseek(static_cast<int>(handle_), 0, SEEK_END);
  if (end < 0) return errno;
  *size = static_cast<uint64_t>(end);
  return 0;
}

int ReadOnlyFile::ListNames(const std::function<bool(const std::string& name)>& take) const {
  const int listfd = dup(static_cast<int>(handle_));
  DIR* d = listfd >= 0 ? fdopendir(listfd) : nullptr;
  if (d == nullptr) {
    const int err = errno;
    if (listfd >= 0) close(listfd);
    return err;
  }
  // The dup shares the folder's offset, which an earlier listing left at its end.
  rewinddir(d);
  int err = 0;
  for (;;) {
    errno = 0;  // readdir's end and its failure both return null
    const dirent* e = readdir(d);
    if (e == nullptr) {
      err = errno;
      break;
    }
    if (!take(e->d_name)) break;
  }
  closedir(d);
  return err;
}

void ReadOnlyFile::DropFromCache(uint64_t offset, uint64_t bytes) const {
  posix_fadvise(static_cast<int>(handle_), static_cast<off_t>(offset), static_cast<off_t>(bytes),
                POSIX_FADV_DONTNEED);
}

bool IsAbsolutePath(const std::string& path) { return !path.empty() && path[0] == '/'; }

char PathSeparator() { return '/'; }

int TakeFilesystemIdentity(UserId uid, GroupId gid, const std::vector<GroupId>& groups) {
  std::vector<GroupId> list = groups;
  if (syscall(SYS_setgroups, list.size(), list.data()) != 0 || syscall(SYS_setfsgid, gid) < 0 ||
      syscall(SYS_setfsuid, uid) < 0 ||
      static_cast<UserId>(syscall(SYS_setfsuid, static_cast<UserId>(-1))) != uid ||
      static_cast<GroupId>(syscall(SYS_setfsgid, static_cast<GroupId>(-1))) != gid) {
    return errno != 0 ? errno : EPERM;
  }
  return 0;
}

}  // namespace trainstream::platform
