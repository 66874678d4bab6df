// The Linux side of trainstream/platform/socket_peer.h, moved from
// daemon/transport/peer_credentials.cc as it was.
#include <grp.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include <cerrno>
#include <utility>

#include "trainstream/platform/socket_peer.h"

namespace trainstream::platform {

int ReadSocketPeer(int fd, SocketPeer* out) {
  struct ucred cred {};
  socklen_t len = sizeof(cred);
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) return errno;
  out->pid = cred.pid;
  out->uid = cred.uid;
  out->gid = cred.gid;
  out->groups.clear();
#ifdef SO_PEERGROUPS
  std::vector<GroupId> groups(64);
  socklen_t glen = static_cast<socklen_t>(groups.size() * sizeof(GroupId));
  if (getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups.data(), &glen) != 0 && errno == ERANGE) {
    groups.resize(glen / sizeof(GroupId) + 1);
    glen = static_cast<socklen_t>(groups.size() * sizeof(GroupId));
    if (getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups.data(), &glen) != 0) glen = 0;
  }
  groups.resize(glen / sizeof(GroupId));
  out->groups = std::move(groups);
#endif
  return 0;
}

int LookupGroup(const std::string& name, GroupId* gid) {
  struct group gr {};
  struct group* result = nullptr;
  std::vector<char> buf(16384);
  const int err = getgrnam_r(name.c_str(), &gr, buf.data(), buf.size(), &result);
  if (err != 0) return err;
  if (result == nullptr) return ENOENT;
  *gid = result->gr_gid;
  return 0;
}

int DescriptorIdentity(int fd, uint64_t* dev, uint64_t* ino) {
  struct stat st {};
  if (fstat(fd, &st) != 0) return errno;
  *dev = st.st_dev;
  *ino = st.st_ino;
  return 0;
}

}  // namespace trainstream::platform
