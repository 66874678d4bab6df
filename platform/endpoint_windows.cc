// The Windows side of the endpoint seam (trainstream/platform/endpoint.h):
// a file created with the owner-only DACL that segments have
// (windows_common.h), moved over the old one with MoveFileExW.
#include <windows.h>

#include <filesystem>
#include <string>

#include "endpoint_system.h"
#include "windows_common.h"

namespace trainstream::platform::internal {

int ReplaceWithOwnerOnlyFile(const std::string& path, const std::string& contents) {
  const std::wstring target = std::filesystem::path(path).wstring();
  const std::wstring temp = target + L".new." + std::to_wstring(GetCurrentProcessId());
  DeleteFileW(temp.c_str());  // a leftover of a crashed writer with this pid
  OwnerOnly security;
  if (int err = security.Init()) return err;
  HANDLE file = CreateFileW(temp.c_str(), GENERIC_WRITE, 0, security.attributes(), CREATE_NEW,
                            FILE_ATTRIBUTE_NORMAL, nullptr);
  if (file == INVALID_HANDLE_VALUE) return LastErrno();
  DWORD written = 0;
  int err = 0;
  if (!WriteFile(file, contents.data(), static_cast<DWORD>(contents.size()), &written, nullptr) ||
      written != contents.size()) {
    err = LastErrno();
    if (err == 0) err = EIO;
  }
  CloseHandle(file);
  if (err == 0 && !MoveFileExW(temp.c_str(), target.c_str(), MOVEFILE_REPLACE_EXISTING)) {
    err = LastErrno();
  }
  if (err != 0) DeleteFileW(temp.c_str());
  return err;
}

}  // namespace trainstream::platform::internal
