// The Windows side's own rule for segments (Note [Segments on Windows are files
// with an owner-only DACL], platform/shm_windows.cc): a new segment's
// DACL is protected and grants the process's user, and nobody else, access.
#include <windows.h>
// After windows.h:
#include <aclapi.h>

#include <filesystem>
#include <random>
#include <string>
#include <system_error>
#include <vector>

#include "catch_compat.h"
#include "trainstream/platform/shm.h"

using namespace trainstream::platform;
namespace fs = std::filesystem;

namespace {

std::vector<unsigned char> ProcessUser() {
  HANDLE token = nullptr;
  REQUIRE(OpenProcessToken(GetCurrentProcess(), TOKEN_QUERY, &token));
  DWORD bytes = 0;
  GetTokenInformation(token, TokenUser, nullptr, 0, &bytes);
  std::vector<unsigned char> user(bytes);
  REQUIRE(GetTokenInformation(token, TokenUser, user.data(), bytes, &bytes));
  CloseHandle(token);
  return user;
}

}  // namespace

TEST_CASE("a new segment's DACL is protected and names only its creator", "[shm]") {
  std::random_device seed;
  const fs::path dir = fs::temp_directory_path() / ("ts-shmdacl-" + std::to_string(seed()));
  fs::create_directory(dir);
  ShmFile file;
  REQUIRE(ShmFile::Create(dir.string(), "seg", &file) == 0);
  file = ShmFile();

  PACL dacl = nullptr;
  PSECURITY_DESCRIPTOR descriptor = nullptr;
  const std::wstring path = (dir / "seg").wstring();
  REQUIRE(GetNamedSecurityInfoW(path.c_str(), SE_FILE_OBJECT, DACL_SECURITY_INFORMATION, nullptr,
                                nullptr, &dacl, nullptr, &descriptor) == ERROR_SUCCESS);
  SECURITY_DESCRIPTOR_CONTROL control = 0;
  DWORD revision = 0;
  REQUIRE(GetSecurityDescriptorControl(descriptor, &control, &revision));
  CHECK((control & SE_DACL_PROTECTED) != 0);
  REQUIRE(dacl != nullptr);
  REQUIRE(dacl->AceCount == 1);
  void* ace = nullptr;
  REQUIRE(GetAce(dacl, 0, &ace));
  auto* allowed = static_cast<ACCESS_ALLOWED_ACE*>(ace);
  CHECK(allowed->Header.AceType == ACCESS_ALLOWED_ACE_TYPE);
  std::vector<unsigned char> user = ProcessUser();
  CHECK(EqualSid(reinterpret_cast<PSID>(&allowed->SidStart),
                 reinterpret_cast<TOKEN_USER*>(user.data())->User.Sid));
  LocalFree(descriptor);

  REQUIRE(ShmFile::Remove(dir.string(), "seg") == 0);
  std::error_code ignored;
  fs::remove_all(dir, ignored);
}
