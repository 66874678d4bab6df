// What the Windows sides of the seam share (not part of its interface):
// Win32 errors as errno values, UTF-8 paths in wide form, the walk over a
// folder's entries (files_windows.cc, read_only_file_windows.cc), and the
// owner-only security descriptor of the files they create (segments,
// shm_windows.cc; the endpoint file, endpoint_windows.cc).
#pragma once

#include <windows.h>

#include <cerrno>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

namespace trainstream::platform::internal {

inline int ErrnoOf(DWORD error) {
  switch (error) {
    case ERROR_FILE_EXISTS:
    case ERROR_ALREADY_EXISTS:
      return EEXIST;
    case ERROR_FILE_NOT_FOUND:
    case ERROR_PATH_NOT_FOUND:
      return ENOENT;
    case ERROR_ACCESS_DENIED:
      return EACCES;
    case ERROR_SHARING_VIOLATION:
    case ERROR_LOCK_VIOLATION:
      return EBUSY;
    case ERROR_DISK_FULL:
    case ERROR_HANDLE_DISK_FULL:
      return ENOSPC;
    case ERROR_NOT_ENOUGH_MEMORY:
    case ERROR_OUTOFMEMORY:
    case ERROR_COMMITMENT_LIMIT:
      return ENOMEM;
    case ERROR_INVALID_PARAMETER:
    case ERROR_INVALID_NAME:
      return EINVAL;
    case ERROR_WORKING_SET_QUOTA:
      return EAGAIN;  // as mlock over RLIMIT_MEMLOCK
    case ERROR_PRIVILEGE_NOT_HELD:
      return EPERM;
    default:
      return EIO;
  }
}

inline int LastErrno() { return ErrnoOf(GetLastError()); }

// A UTF-8 path in the form the wide Win32 calls take.
inline std::wstring WidePath(const std::string& utf8) {
  return std::filesystem::u8path(utf8).wstring();
}

// Gives each entry of the folder `dir` (the system's "." and ".." among them)
// to `take` until it returns false. 0, or an errno value: the folder could not
// be listed, or the listing failed part way (the entries before the failure
// were given).
inline int ForEachFound(const std::string& dir,
                        const std::function<bool(const WIN32_FIND_DATAW& found)>& take) {
  WIN32_FIND_DATAW found{};
  const std::wstring pattern = WidePath(dir) + L"\\*";
  HANDLE search =
      FindFirstFileExW(pattern.c_str(), FindExInfoBasic, &found, FindExSearchNameMatch, nullptr, 0);
  if (search == INVALID_HANDLE_VALUE) {
    // An empty folder on a file system without "." and "..".
    return GetLastError() == ERROR_FILE_NOT_FOUND ? 0 : LastErrno();
  }
  DWORD last = ERROR_NO_MORE_FILES;
  while (take(found)) {
    if (!FindNextFileW(search, &found)) {
      last = GetLastError();
      break;
    }
  }
  FindClose(search);
  return last == ERROR_NO_MORE_FILES ? 0 : ErrnoOf(last);
}

// The owner-only security descriptor of a new segment or endpoint file (Note
// [Segments on Windows are files with an owner-only DACL], shm_windows.cc). The buffers back
// `attributes`.
class OwnerOnly {
 public:
  // 0 or an errno value.
  int Init() {
    HANDLE token = nullptr;
    if (!OpenProcessToken(GetCurrentProcess(), TOKEN_QUERY, &token)) return LastErrno();
    DWORD bytes = 0;
    GetTokenInformation(token, TokenUser, nullptr, 0, &bytes);
    user_.resize(bytes);
    const bool ok =
        bytes != 0 && GetTokenInformation(token, TokenUser, user_.data(), bytes, &bytes);
    const DWORD error = GetLastError();
    CloseHandle(token);
    if (!ok) return ErrnoOf(error);
    PSID sid = reinterpret_cast<TOKEN_USER*>(user_.data())->User.Sid;
    acl_.resize(sizeof(ACL) + sizeof(ACCESS_ALLOWED_ACE) + GetLengthSid(sid));
    auto* acl = reinterpret_cast<ACL*>(acl_.data());
    if (!InitializeAcl(acl, static_cast<DWORD>(acl_.size()), ACL_REVISION) ||
        !AddAccessAllowedAce(acl, ACL_REVISION, GENERIC_ALL, sid) ||
        !InitializeSecurityDescriptor(&descriptor_, SECURITY_DESCRIPTOR_REVISION) ||
        !SetSecurityDescriptorDacl(&descriptor_, TRUE, acl, FALSE) ||
        !SetSecurityDescriptorControl(&descriptor_, SE_DACL_PROTECTED, SE_DACL_PROTECTED)) {
      return LastErrno();
    }
    attributes_ = SECURITY_ATTRIBUTES{sizeof(SECURITY_ATTRIBUTES), &descriptor_, FALSE};
    return 0;
  }
  SECURITY_ATTRIBUTES* attributes() { return &attributes_; }

 private:
  std::vector<unsigned char> user_;  // TOKEN_USER
  std::vector<unsigned char> acl_;   // DWORD-aligned by the allocator
  SECURITY_DESCRIPTOR descriptor_{};
  SECURITY_ATTRIBUTES attributes_{};
};

}  // namespace trainstream::platform::internal
