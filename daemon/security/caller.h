// PeerCredentials: who made a request, as the kernel reported it for the
// connection (SO_PEERCRED, SO_PEERGROUPS) and the access policy judged it. Every
// layer that acts for a caller (sessions, the base cache) takes one; reading and
// judging it is the transport's job (transport/peer_credentials.h).
#pragma once

#include <sys/types.h>

#include <vector>

#include "trainstream/platform/user.h"

namespace trainstream::daemon {

struct PeerCredentials {
  pid_t pid = 0;
  platform::UserId uid = 0;
  platform::GroupId gid = 0;
  std::vector<platform::GroupId> groups;  // supplementary groups (SO_PEERGROUPS)
  bool allowed = false;                   // may use the daemon
  bool admin = false;                     // may also shut it down
};

}  // namespace trainstream::daemon
