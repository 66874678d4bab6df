// The platform seam for the daemon's plain file work that is no mapping: a
// folder's listing (the startup sweep of segments, adoption), reading the
// start of a file it did not create (a segment's header, the lock file's
// previous owner), rewriting a small file in place (the lock file) and
// removing a file. Segments themselves, which are mapped, are
// platform/shm.h's; the endpoint's owner-only file is platform/endpoint.h's.
//
// A folder like /dev/shm is shared with clients, who may plant symlinks and
// FIFOs there, so nothing here follows a symlink or blocks on a special file:
// listing reports what an entry is without following it, and reading refuses
// anything but a regular file. Two sides, picked by
// platform/CMakeLists.txt: files_linux.cc (readdir + lstat, open with
// O_NOFOLLOW | O_NONBLOCK, pread) and files_windows.cc (FindFirstFileW with
// reparse points reported as links, CreateFileW with
// FILE_FLAG_OPEN_REPARSE_POINT, ReadFile at an offset).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace trainstream::platform {

enum class FileKind { kRegular, kDirectory, kLink, kOther };

struct DirectoryEntry {
  std::string name;   // the entry's name in its folder (no "." or "..")
  FileKind kind;      // what the entry itself is: a link is kLink, never followed
  uint64_t size = 0;  // bytes, for a regular file
};

// The entries of `dir`, in no particular order. Returns 0, ENOENT, ENOTDIR,
// EACCES or another errno value.
int ListDirectory(const std::string& dir, std::vector<DirectoryEntry>* out);

// Reads up to `max_bytes` from the start of the regular file at `path` into
// `out` (fewer when the file is shorter). Returns 0, ENOENT, ELOOP (`path` is a
// link), EINVAL (it is not a regular file: a folder, a FIFO, a device), EACCES,
// or another errno value. Never blocks on a special file.
int ReadFilePrefix(const std::string& path, size_t max_bytes, std::string* out);

// Replaces the contents of the existing regular file at `path` with `text`
// (truncates, then writes from the start), keeping the file itself: its
// identity, owner and any lock held on it. Not atomic: a reader may see it
// empty or part written. 0, ENOENT, ELOOP or an errno value.
int OverwriteFile(const std::string& path, const std::string& text);

// Whether this process may create files in the folder `dir`: 0, ENOENT,
// ENOTDIR, EACCES or another errno value. Linux: access(W_OK | X_OK) for the
// effective ids; Windows: a probe file created and removed.
int CheckWritableDirectory(const std::string& dir);

// Removes the file (or link: never what it points to) at `path`. 0, ENOENT or
// an errno value.
int RemoveFile(const std::string& path);

// Creates the folder `dir` and whichever of its parents are missing. 0 or an
// errno value.
int MakeDirectories(const std::string& dir);

// Takes an exclusive lock on the file `path` (created if missing, readable
// and writable by this user alone), held until UnlockFile(*handle). 0,
// EWOULDBLOCK when another holder has it, or an errno value. Linux:
// flock(LOCK_EX | LOCK_NB). Windows: LockFileEx on one byte far past the end,
// so this process's other handles still read and rewrite the file
// (ReadFilePrefix, OverwriteFile) and nothing else is locked out of it.
int LockFile(const std::string& path, intptr_t* handle);
void UnlockFile(intptr_t handle);

}  // namespace trainstream::platform
