// The Windows side of trainstream/platform/read_only_file.h. A reparse point
// (a symbolic link or a junction) is opened as itself
// (FILE_FLAG_OPEN_REPARSE_POINT) and reported as neither a regular file nor a
// folder, so the caller refuses it: nothing is read through a link. A folder
// is opened (FILE_FLAG_BACKUP_SEMANTICS) to check what it is; names under it
// are opened by the folder's path joined with the name.
#include <windows.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <filesystem>
#include <string>

#include "trainstream/platform/read_only_file.h"
#include "windows_common.h"

namespace trainstream::platform {
namespace {

using internal::WidePath;

HANDLE AsHandle(intptr_t h) { return reinterpret_cast<HANDLE>(h); }

// 100 ns ticks since 1601 to ns since 1970.
uint64_t UnixNanoseconds(const FILETIME& t) {
  const uint64_t ticks = (static_cast<uint64_t>(t.dwHighDateTime) << 32) | t.dwLowDateTime;
  constexpr uint64_t kTicksTo1970 = 116444736000000000ull;
  return ticks < kTicksTo1970 ? 0 : (ticks - kTicksTo1970) * 100;
}

}  // namespace

void ReadOnlyFile::Close() {
  if (handle_ != kNone) CloseHandle(AsHandle(handle_));
  handle_ = kNone;
}

int ReadOnlyFile::Open(const ReadOnlyFile* dir, const std::string& name, ReadOnlyFile* out) {
  *out = ReadOnlyFile();
  std::string path = name;
  if (dir != nullptr && !IsAbsolutePath(name)) path = dir->path_ + "\\" + name;
  HANDLE file = CreateFileW(
      WidePath(path).c_str(), GENERIC_READ, FILE_SHARE_READ | FILE_SHARE_WRITE | FILE_SHARE_DELETE,
      nullptr, OPEN_EXISTING, FILE_FLAG_OPEN_REPARSE_POINT | FILE_FLAG_BACKUP_SEMANTICS, nullptr);
  if (file == INVALID_HANDLE_VALUE) return internal::LastErrno();
  out->handle_ = reinterpret_cast<intptr_t>(file);
  out->path_ = path;
  BY_HANDLE_FILE_INFORMATION info{};
  if (!GetFileInformationByHandle(file, &info)) {
    const int err = internal::LastErrno();
    *out = ReadOnlyFile();
    return err;
  }
  const DWORD a = info.dwFileAttributes;
  const bool link = (a & FILE_ATTRIBUTE_REPARSE_POINT) != 0;
  ReadOnlyFileFacts& f = out->facts_;
  f.directory = !link && (a & FILE_ATTRIBUTE_DIRECTORY) != 0;
  f.regular = !link && !f.directory && (a & FILE_ATTRIBUTE_DEVICE) == 0 &&
              GetFileType(file) == FILE_TYPE_DISK;
  f.size = (static_cast<uint64_t>(info.nFileSizeHigh) << 32) | info.nFileSizeLow;
  f.dev = info.dwVolumeSerialNumber;
  f.ino = (static_cast<uint64_t>(info.nFileIndexHigh) << 32) | info.nFileIndexLow;
  f.mtime_ns = UnixNanoseconds(info.ftLastWriteTime);
  return 0;
}

int64_t ReadOnlyFile::ReadAt(void* dst, size_t n, uint64_t offset) const {
  OVERLAPPED at{};
  at.Offset = static_cast<DWORD>(offset);
  at.OffsetHigh = static_cast<DWORD>(offset >> 32);
  DWORD got = 0;
  const DWORD want = static_cast<DWORD>(std::min<size_t>(n, 1u << 30));
  if (!ReadFile(AsHandle(handle_), dst, want, &got, &at)) {
    if (GetLastError() == ERROR_HANDLE_EOF) return 0;
    errno = internal::LastErrno();
    return -1;
  }
  return got;
}

int ReadOnlyFile::CurrentSize(uint64_t* size) const {
  LARGE_INTEGER end{};
  if (!GetFileSizeEx(AsHandle(handle_), &end)) return internal::LastErrno();
  *size = static_cast<uint64_t>(end.QuadPart);
  return 0;
}

int ReadOnlyFile::ListNames(const std::function<bool(const std::string& name)>& take) const {
  return internal::ForEachFound(path_, [&take](const WIN32_FIND_DATAW& found) {
    return take(std::filesystem::path(found.cFileName).u8string());
  });
}

void ReadOnlyFile::DropFromCache(uint64_t, uint64_t) const {}

bool IsAbsolutePath(const std::string& path) {
  const bool drive = path.size() >= 3 && std::isalpha(static_cast<unsigned char>(path[0])) &&
                     path[1] == ':' && (path[2] == '\\' || path[2] == '/');
  const bool share = path.size() >= 2 && path[0] == '\\' && path[1] == '\\';
  return drive || share;
}

char PathSeparator() { return '\\'; }

int TakeFilesystemIdentity(UserId, GroupId, const std::vector<GroupId>&) { return ENOTSUP; }

}  // namespace trainstream::platform
