// The Windows side of trainstream/platform/socket_peer.h: nothing the kernel
// can say about the daemon's loopback connections (see the header).
#include <cerrno>

#include "trainstream/platform/socket_peer.h"

namespace trainstream::platform {

int ReadSocketPeer(int, SocketPeer*) { return ENOTSUP; }

int LookupGroup(const std::string&, GroupId*) { return ENOTSUP; }

int DescriptorIdentity(int, uint64_t*, uint64_t*) { return ENOTSUP; }

}  // namespace trainstream::platform
