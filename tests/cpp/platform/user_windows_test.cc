// The Windows side of platform/user.h: the process token, named as
// DOMAIN\user (the user is %USERNAME%, which Wine sets too).
#include <windows.h>

#include <cstdlib>
#include <string>

#include "catch_compat.h"
#include "trainstream/platform/user.h"

using namespace trainstream::platform;

TEST_CASE("on Windows the user is the token's, DOMAIN\\name", "[user]") {
  const std::string who = DescribeCurrentUser();
  const char* name = std::getenv("USERNAME");
  REQUIRE(name != nullptr);
  const size_t slash = who.find('\\');
  REQUIRE(slash != std::string::npos);
  // Account names compare without regard to case.
  CHECK(CompareStringA(LOCALE_INVARIANT, NORM_IGNORECASE, who.c_str() + slash + 1, -1, name, -1) ==
        CSTR_EQUAL);
}
