// The platform seam for who this process runs as: whether it has the system's
// full rights (which decides, among other things, where the daemon's endpoint
// goes and whether it may hand segments to other users), and this user in
// words for messages. Two sides, picked by proto/platform/CMakeLists.txt:
// user_linux.cc (the effective uid, getpwuid_r) and user_windows.cc (the
// process token: LocalSystem or elevated; LookupAccountSidW).
#pragma once

#include <string>

namespace trainstream::platform {

// True when this process runs with the system's full rights: effective uid 0
// on Linux; on Windows, as LocalSystem (a service's default account) or with
// an elevated token.
bool RunsPrivileged();

// This process's user for a message: "uid 1000 (alice)" on Linux,
// "DOMAIN\alice" on Windows (the SID when the name cannot be looked up).
std::string DescribeCurrentUser();

}  // namespace trainstream::platform
