// The platform seam for who this process runs as: whether it has the system's
// full rights (which decides, among other things, where the daemon's endpoint
// goes and whether it may hand segments to other users), and this user in
// words for messages. Two sides, picked by platform/CMakeLists.txt:
// user_linux.cc (the effective uid, getpwuid_r) and user_windows.cc (the
// process token: LocalSystem or elevated; LookupAccountSidW).
#pragma once

#include <cstdint>
#include <string>

namespace trainstream::platform {

// A user and a group as the daemon's access rules count them. Linux: uid_t and
// gid_t (32-bit). Windows: the relative id (the last sub-authority) of the
// account's SID, which names an account of this machine or its domain; the
// daemon compares it only with ids made the same way (on Windows every caller
// proved it is the daemon's own user: Note [A secret in an owner-only file
// stands in for SO_PEERCRED]).
using UserId = uint32_t;
using GroupId = uint32_t;

// This process's (effective) user.
UserId CurrentUserId();

// True when this process runs with the system's full rights: effective uid 0
// on Linux; on Windows, as LocalSystem (a service's default account) or with
// an elevated token.
bool RunsPrivileged();

// This process's user for a message: "uid 1000 (alice)" on Linux,
// "DOMAIN\alice" on Windows (the SID when the name cannot be looked up).
std::string DescribeCurrentUser();

}  // namespace trainstream::platform
