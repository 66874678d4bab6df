// The Windows side of trainstream/platform/files.h. A reparse point (a
// symbolic link or a junction) is reported as a link and never followed:
// FILE_FLAG_OPEN_REPARSE_POINT opens the point itself, which is then refused.
#include <windows.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <string>
#include <vector>

#include "trainstream/platform/files.h"
#include "windows_common.h"

namespace trainstream::platform {
namespace {

using internal::WidePath;

FileKind KindOf(DWORD attributes) {
  if ((attributes & FILE_ATTRIBUTE_REPARSE_POINT) != 0) return FileKind::kLink;
  if ((attributes & FILE_ATTRIBUTE_DIRECTORY) != 0) return FileKind::kDirectory;
  if ((attributes & FILE_ATTRIBUTE_DEVICE) != 0) return FileKind::kOther;
  return FileKind::kRegular;
}

// Opens the regular file at `path` with `access`, sharing it with every other
// opener (the daemon's own handles on segments and the lock file). Returns
// the handle, or INVALID_HANDLE_VALUE with *err set.
HANDLE OpenRegular(const std::string& path, DWORD access, int* err) {
  const std::wstring wide = WidePath(path);
  const DWORD attributes = GetFileAttributesW(wide.c_str());
  if (attributes == INVALID_FILE_ATTRIBUTES) {
    *err = internal::LastErrno();
    return INVALID_HANDLE_VALUE;
  }
  const FileKind kind = KindOf(attributes);
  if (kind != FileKind::kRegular) {
    *err = kind == FileKind::kLink ? ELOOP : EINVAL;
    return INVALID_HANDLE_VALUE;
  }
  HANDLE file =
      CreateFileW(wide.c_str(), access, FILE_SHARE_READ | FILE_SHARE_WRITE | FILE_SHARE_DELETE,
                  nullptr, OPEN_EXISTING, FILE_FLAG_OPEN_REPARSE_POINT, nullptr);
  if (file == INVALID_HANDLE_VALUE) {
    *err = internal::LastErrno();
    return file;
  }
  // Checked again on the handle: the name may have been replaced meanwhile.
  BY_HANDLE_FILE_INFORMATION info{};
  if (!GetFileInformationByHandle(file, &info) || GetFileType(file) != FILE_TYPE_DISK ||
      KindOf(info.dwFileAttributes) != FileKind::kRegular) {
    *err = KindOf(info.dwFileAttributes) == FileKind::kLink ? ELOOP : EINVAL;
    CloseHandle(file);
    return INVALID_HANDLE_VALUE;
  }
  return file;
}

}  // namespace

int ListDirectory(const std::string& dir, std::vector<DirectoryEntry>* out) {
  out->clear();
  const DWORD attributes = GetFileAttributesW(WidePath(dir).c_str());
  if (attributes == INVALID_FILE_ATTRIBUTES) return internal::LastErrno();
  if ((attributes & FILE_ATTRIBUTE_DIRECTORY) == 0) return ENOTDIR;
  return internal::ForEachFound(dir, [out](const WIN32_FIND_DATAW& found) {
    const std::wstring name = found.cFileName;
    if (name == L"." || name == L"..") return true;
    DirectoryEntry entry{std::filesystem::path(name).u8string(), KindOf(found.dwFileAttributes), 0};
    if (entry.kind == FileKind::kRegular) {
      entry.size = (static_cast<uint64_t>(found.nFileSizeHigh) << 32) | found.nFileSizeLow;
    }
    out->push_back(std::move(entry));
    return true;
  });
}

int ReadFilePrefix(const std::string& path, size_t max_bytes, std::string* out) {
  out->clear();
  int err = 0;
  HANDLE file = OpenRegular(path, GENERIC_READ, &err);
  if (file == INVALID_HANDLE_VALUE) return err;
  out->resize(max_bytes);
  size_t done = 0;
  while (done < max_bytes) {
    const DWORD want = static_cast<DWORD>(std::min<size_t>(max_bytes - done, 1u << 30));
    DWORD got = 0;
    if (!ReadFile(file, out->data() + done, want, &got, nullptr)) {
      err = internal::LastErrno();
      break;
    }
    if (got == 0) break;
    done += got;
  }
  CloseHandle(file);
  out->resize(done);
  return err;
}

int OverwriteFile(const std::string& path, const std::string& text) {
  int err = 0;
  HANDLE file = OpenRegular(path, GENERIC_READ | GENERIC_WRITE, &err);
  if (file == INVALID_HANDLE_VALUE) return err;
  if (!SetEndOfFile(file)) err = internal::LastErrno();  // at offset 0: truncates
  DWORD written = 0;
  if (err == 0 &&
      (!WriteFile(file, text.data(), static_cast<DWORD>(text.size()), &written, nullptr) ||
       written != text.size())) {
    err = internal::LastErrno();
    if (err == 0) err = EIO;
  }
  CloseHandle(file);
  return err;
}

int CheckWritableDirectory(const std::string& dir) {
  const DWORD attributes = GetFileAttributesW(WidePath(dir).c_str());
  if (attributes == INVALID_FILE_ATTRIBUTES) return internal::LastErrno();
  if ((attributes & FILE_ATTRIBUTE_DIRECTORY) == 0) return ENOTDIR;
  // Rights on Windows come from the folder's DACL and the token's groups and
  // privileges: asking the file system is the one sure answer.
  const std::wstring probe =
      WidePath(dir) + L"\\.trainstream-probe-" + std::to_wstring(GetCurrentProcessId());
  HANDLE file = CreateFileW(probe.c_str(), GENERIC_WRITE, 0, nullptr, CREATE_ALWAYS,
                            FILE_ATTRIBUTE_TEMPORARY | FILE_FLAG_DELETE_ON_CLOSE, nullptr);
  if (file == INVALID_HANDLE_VALUE) return internal::LastErrno();
  CloseHandle(file);
  return 0;
}

int RemoveFile(const std::string& path) {
  return DeleteFileW(WidePath(path).c_str()) ? 0 : internal::LastErrno();
}

int MakeDirectories(const std::string& dir) {
  std::error_code error;
  std::filesystem::create_directories(std::filesystem::u8path(dir), error);
  return error ? (error.value() == ERROR_ACCESS_DENIED ? EACCES : EIO) : 0;
}

int LockFile(const std::string& path, intptr_t* handle) {
  internal::OwnerOnly owner;
  if (int err = owner.Init(); err != 0) return err;
  HANDLE file = CreateFileW(WidePath(path).c_str(), GENERIC_READ | GENERIC_WRITE,
                            FILE_SHARE_READ | FILE_SHARE_WRITE | FILE_SHARE_DELETE,
                            owner.attributes(), OPEN_ALWAYS, FILE_ATTRIBUTE_NORMAL, nullptr);
  if (file == INVALID_HANDLE_VALUE) return internal::LastErrno();
  // One byte at 2^62: past any end the file will have, so no read or write of
  // its text meets the lock.
  OVERLAPPED at{};
  at.OffsetHigh = 1u << 30;
  if (!LockFileEx(file, LOCKFILE_EXCLUSIVE_LOCK | LOCKFILE_FAIL_IMMEDIATELY, 0, 1, 0, &at)) {
    const DWORD error = GetLastError();
    CloseHandle(file);
    return error == ERROR_LOCK_VIOLATION ? EWOULDBLOCK : internal::ErrnoOf(error);
  }
  *handle = reinterpret_cast<intptr_t>(file);
  return 0;
}

void UnlockFile(intptr_t handle) { CloseHandle(reinterpret_cast<HANDLE>(handle)); }

}  // namespace trainstream::platform
