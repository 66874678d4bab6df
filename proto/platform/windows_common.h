// What the Windows sides of the seam share (not part of its interface):
// Win32 errors as errno values, and the owner-only security descriptor of the
// files they create (segments, shm_windows.cc; the endpoint file,
// endpoint_windows.cc).
#pragma once

#include <windows.h>

#include <cerrno>
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
