// Who is on the other end of a connected socket, as the kernel says, and the
// groups the access policy names.
//
// Linux: SO_PEERCRED and SO_PEERGROUPS of a unix socket, getgrnam_r, and an
// fd's identity (fstat's st_dev, st_ino) to tell a live connection from a
// number gRPC closed and the system reused (Note [Counting connections gRPC
// owns], daemon/transport/peer_credentials.h).
// Windows: none of these. gRPC owns the daemon's loopback socket, and the
// endpoint secret stands in for the kernel's word (Note [A secret in an
// owner-only file stands in for SO_PEERCRED], endpoint_windows.cc): every call
// fails with ENOTSUP, and a client's process is the one it states in Attach,
// checked against this process's user (SessionProcess, process_watcher.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "trainstream/platform/user.h"

namespace trainstream::platform {

struct SocketPeer {
  int64_t pid = 0;
  UserId uid = 0;
  GroupId gid = 0;
  std::vector<GroupId> groups;  // supplementary groups, where the kernel tells them
};

// The peer of the connected socket `fd`. 0 or an errno value.
int ReadSocketPeer(int fd, SocketPeer* out);

// The group called `name`. 0, ENOENT when there is none, or an errno value
// (ENOTSUP on Windows).
int LookupGroup(const std::string& name, GroupId* gid);

// What the open descriptor `fd` names now (device and inode). 0 or an errno
// value (EBADF: closed; ENOTSUP on Windows).
int DescriptorIdentity(int fd, uint64_t* dev, uint64_t* ino);

}  // namespace trainstream::platform
