// The Linux side of platform/user.h: the effective uid.
#include <unistd.h>

#include <string>

#include "catch_compat.h"
#include "trainstream/platform/user.h"

using namespace trainstream::platform;

TEST_CASE("on Linux the user is the effective uid", "[user]") {
  CHECK(RunsPrivileged() == (geteuid() == 0));
  CHECK(DescribeCurrentUser().rfind("uid " + std::to_string(geteuid()), 0) == 0);
}
