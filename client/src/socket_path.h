// What is at a daemon socket path, in words a user can act on (internal).
#pragma once

#include <string>

namespace trainstream::internal {

// "" when this process (effective uid and groups) may connect to `socket_path`
// as far as file permissions go; else why not and what to do: the socket exists
// but its mode or a directory on the way keeps this uid out, naming the
// socket's group to join, or TRAINSTREAM_SOCKET. Makes no connection.
std::string DescribeAccessDenied(const std::string& socket_path);

// Why nothing usable answered at `socket_path` (after a gRPC connect failed),
// found with one plain connect(): no such socket, a stale socket nobody listens
// on, a full accept queue, or a daemon that accepts and closes at once (over
// its connection cap for this uid, or out of file descriptors: then
// *closed_at_once is set, since a daemon does run there).
std::string DescribeUnreachable(const std::string& socket_path, bool* closed_at_once);

}  // namespace trainstream::internal
