// The Windows side of trainstream/platform/user.h: the process token.
#include <windows.h>
// windows.h first: sddl.h needs its types.
#include <sddl.h>

#include <filesystem>
#include <string>
#include <vector>

#include "trainstream/platform/user.h"

namespace trainstream::platform {
namespace {

// The token's TOKEN_USER, or empty.
std::vector<unsigned char> TokenUser() {
  std::vector<unsigned char> user;
  HANDLE token = nullptr;
  if (!OpenProcessToken(GetCurrentProcess(), TOKEN_QUERY, &token)) return user;
  DWORD bytes = 0;
  GetTokenInformation(token, ::TokenUser, nullptr, 0, &bytes);
  user.resize(bytes);
  if (bytes == 0 || !GetTokenInformation(token, ::TokenUser, user.data(), bytes, &bytes)) {
    user.clear();
  }
  CloseHandle(token);
  return user;
}

std::string Utf8(const std::wstring& wide) { return std::filesystem::path(wide).u8string(); }

}  // namespace

UserId CurrentUserId() {
  const std::vector<unsigned char> user = TokenUser();
  if (user.empty()) return 0;
  PSID sid = reinterpret_cast<const TOKEN_USER*>(user.data())->User.Sid;
  const UCHAR count = *GetSidSubAuthorityCount(sid);
  return count == 0 ? 0 : static_cast<UserId>(*GetSidSubAuthority(sid, count - 1u));
}

bool RunsPrivileged() {
  const std::vector<unsigned char> user = TokenUser();
  if (!user.empty() && IsWellKnownSid(reinterpret_cast<const TOKEN_USER*>(user.data())->User.Sid,
                                      WinLocalSystemSid)) {
    return true;
  }
  HANDLE token = nullptr;
  if (!OpenProcessToken(GetCurrentProcess(), TOKEN_QUERY, &token)) return false;
  TOKEN_ELEVATION elevation{};
  DWORD bytes = 0;
  const bool elevated =
      GetTokenInformation(token, TokenElevation, &elevation, sizeof(elevation), &bytes) &&
      elevation.TokenIsElevated != 0;
  CloseHandle(token);
  return elevated;
}

std::string DescribeCurrentUser() {
  const std::vector<unsigned char> user = TokenUser();
  if (user.empty()) return "an unknown user (the process token cannot be read)";
  PSID sid = reinterpret_cast<const TOKEN_USER*>(user.data())->User.Sid;
  wchar_t name[256], domain[256];
  DWORD name_len = 256, domain_len = 256;
  SID_NAME_USE use;
  if (LookupAccountSidW(nullptr, sid, name, &name_len, domain, &domain_len, &use)) {
    return Utf8(std::wstring(domain, domain_len)) + "\\" + Utf8(std::wstring(name, name_len));
  }
  LPWSTR text = nullptr;
  std::string sid_text = "an unnamed user";
  if (ConvertSidToStringSidW(sid, &text)) {
    sid_text = Utf8(text);
    LocalFree(text);
  }
  return sid_text;
}

}  // namespace trainstream::platform
