// Files the daemon only reads (a base's checkpoint shards), opened under a
// folder it opened first, and the caller's identity for opening them.
//
// Linux: an fd from openat(O_RDONLY | O_NONBLOCK), so a FIFO cannot park the
// opening thread (the flag is cleared again once the file is known to be
// regular), pread, fstat's facts, posix_fadvise(DONTNEED). Links are followed,
// as before: the caller's filesystem identity is what limits the open (Note
// [Caller credentials for base paths], daemon/base/model_sources.h).
// Windows: a handle opened with FILE_FLAG_OPEN_REPARSE_POINT, so a link or
// junction is opened as itself and is neither regular nor a folder (never
// followed); a folder is opened by its path, and names under it are joined to
// that path. Reads at an offset, GetFileInformationByHandle's facts; dropping
// from the cache does nothing. Every caller is the daemon's own user, so there
// is no identity to take (TakeFilesystemIdentity answers ENOTSUP).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "trainstream/platform/user.h"

namespace trainstream::platform {

// What the file was when it was opened. `dev` and `ino` identify it (volume
// serial number and file index on Windows), `mtime_ns` is its last write.
struct ReadOnlyFileFacts {
  bool regular = false;
  bool directory = false;
  uint64_t size = 0;
  uint64_t dev = 0;
  uint64_t ino = 0;
  uint64_t mtime_ns = 0;
};

// One open file or folder. Move-only; closes what it holds.
class ReadOnlyFile {
 public:
  ReadOnlyFile() = default;
  ~ReadOnlyFile();
  ReadOnlyFile(const ReadOnlyFile&) = delete;
  ReadOnlyFile& operator=(const ReadOnlyFile&) = delete;
  ReadOnlyFile(ReadOnlyFile&& o) noexcept;
  ReadOnlyFile& operator=(ReadOnlyFile&& o) noexcept;

  // Opens `name` under the folder `dir` (an open ReadOnlyFile of a folder), or
  // `name` itself when `dir` is null, and reads its facts. Whatever it is
  // (callers check facts().regular or .directory). 0, or an errno value
  // (ENOENT, EACCES, ...); on an error *out holds nothing.
  static int Open(const ReadOnlyFile* dir, const std::string& name, ReadOnlyFile* out);

  bool is_open() const { return handle_ != kNone; }
  const ReadOnlyFileFacts& facts() const { return facts_; }

  // Reads up to `n` bytes at `offset`: the count read (0 at the end of the
  // file), or -1 with errno set (EINTR: try again). Thread-safe.
  int64_t ReadAt(void* dst, size_t n, uint64_t offset) const;

  // The file's size now (it may have changed since it was opened). 0 or an
  // errno value.
  int CurrentSize(uint64_t* size) const;

  // Calls `take` with each name in this folder, in the system's order, until
  // it returns false. 0 or an errno value, also when the listing fails part
  // way (the names before the failure were given).
  int ListNames(const std::function<bool(const std::string& name)>& take) const;

  // Tells the system that [offset, offset + bytes) will not be read again.
  void DropFromCache(uint64_t offset, uint64_t bytes) const;

 private:
  static constexpr intptr_t kNone = -1;
  void Close();
  intptr_t handle_ = kNone;  // an fd on Linux, a HANDLE on Windows
  std::string path_;         // Windows: the path it was opened by (names under a folder)
  ReadOnlyFileFacts facts_;
};

// Whether `path` is absolute on this system ("/..." on Linux; "C:\..." or
// "\\server\..." on Windows).
bool IsAbsolutePath(const std::string& path);

// The separator between a folder and a name under it in messages and paths.
char PathSeparator();

// Switches the calling thread's filesystem identity to `uid`, `gid` and
// `groups` (Linux: the raw setgroups/setfsgid/setfsuid syscalls, which act on
// the calling thread only), so the kernel judges every open that follows as
// that user's. 0, or an errno value; ENOTSUP on Windows, where the daemon
// serves only its own user. Only a privileged daemon can switch.
int TakeFilesystemIdentity(UserId uid, GroupId gid, const std::vector<GroupId>& groups);

}  // namespace trainstream::platform
