// The Linux side of trainstream/platform/user.h: the effective uid.
#include <pwd.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "trainstream/platform/user.h"

namespace trainstream::platform {

static_assert(sizeof(uid_t) == sizeof(UserId) && sizeof(gid_t) == sizeof(GroupId),
              "UserId and GroupId are uid_t and gid_t");

UserId CurrentUserId() { return geteuid(); }

bool RunsPrivileged() { return geteuid() == 0; }

std::string DescribeCurrentUser() {
  const uid_t uid = geteuid();
  std::string text = "uid " + std::to_string(uid);
  passwd pw{};
  passwd* found = nullptr;
  std::vector<char> buf(16384);
  if (getpwuid_r(uid, &pw, buf.data(), buf.size(), &found) == 0 && found != nullptr) {
    text += " (" + std::string(found->pw_name) + ")";
  }
  return text;
}

}  // namespace trainstream::platform
