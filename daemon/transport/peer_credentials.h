// Who is on the other end of a connection, and what they may do.
//
// Note [Peer credentials for fd channels]: the daemon accepts connections on its
// unix socket itself, reads SO_PEERCRED/SO_PEERGROUPS, and hands each fd to gRPC
// with AddInsecureChannelFromFd. gRPC 1.51 names such a channel's peer "fd:<N>"
// (ServerContext::peer()), so handlers find the caller's credentials by fd
// number. An fd number is reused only after gRPC closed the previous connection
// on it, and the accept loop overwrites the entry before handing the new fd on.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "security/caller.h"
#include "trainstream/platform/user.h"

namespace trainstream::daemon {

// Reads SO_PEERCRED and SO_PEERGROUPS of a connected unix socket.
bool ReadPeerCredentials(int fd, PeerCredentials* out);

// The access rule: root and the daemon's own uid are always allowed and admin;
// members of `allow_group` may use the daemon; members of `admin_group` may also
// shut it down (and use it).
class AccessPolicy {
 public:
  // Group names are resolved once; an unknown group name is an error the caller
  // reports (see Resolve).
  AccessPolicy() = default;
  bool Resolve(const std::string& allow_group, const std::string& admin_group, std::string* error);
  void Apply(PeerCredentials* creds) const;
  bool has_allow_group() const { return allow_gid_set_; }
  platform::GroupId allow_gid() const { return allow_gid_; }

 private:
  static bool InGroup(const PeerCredentials& c, platform::GroupId g);
  platform::UserId daemon_uid_ = 0;
  bool allow_gid_set_ = false, admin_gid_set_ = false;
  platform::GroupId allow_gid_ = 0, admin_gid_ = 0;
};

// fd number -> credentials of the connection on it, and how many connections
// each uid holds. Thread-safe.
//
// Note [Counting connections gRPC owns]: gRPC closes an accepted fd itself, and
// tells nobody. So Admit() records the socket's identity (st_dev, st_ino) with
// its fd, and a count prunes every entry whose fd no longer names that socket
// (fstat fails: closed; another inode: the number was reused by a file). The
// accept thread is the only one that admits, so an fd cannot be reused by a new
// connection between the prune and the overwrite. Counting costs one fstat per
// connection of that uid (~0.3 us each), and runs only when the uid's recorded
// count has reached the cap.
//
// Note [Callers without a connection identity]: where the listener cannot
// tell connections apart (Windows: gRPC owns the loopback socket, and the
// endpoint secret, which ControlService::Authorize checks before it looks a
// caller up, is what proves who calls), it admits kEveryConnection once, and
// every call not on a recorded fd gets those credentials. The Linux listener
// never does, so there a call on an unknown fd is still refused.
class PeerTable {
 public:
  static constexpr int kEveryConnection = -1;

  // Records `fd` for `creds` unless creds.uid already holds `max_per_uid` live
  // connections (0: no cap). False (nothing recorded) when over the cap; then
  // *live is that uid's count. kEveryConnection: see the Note; no cap, *live 0.
  bool Admit(int fd, const PeerCredentials& creds, uint32_t max_per_uid, uint32_t* live);
  void Set(int fd, const PeerCredentials& creds);
  // Looks up a ServerContext::peer() string ("fd:12"); else the
  // kEveryConnection credentials, when admitted. False when unknown.
  bool Lookup(const std::string& peer, PeerCredentials* out) const;
  // Live connections of `uid` (prunes closed ones first).
  uint32_t LiveConnections(platform::UserId uid);

 private:
  struct Entry {
    PeerCredentials creds;
    uint64_t dev = 0;
    uint64_t ino = 0;
  };
  uint32_t PruneAndCountLocked(platform::UserId uid);
  bool LookupFd(const std::string& peer, PeerCredentials* out) const;

  mutable std::mutex mu_;
  std::unordered_map<int, Entry> by_fd_;                     // Guarded by mu_.
  std::unordered_map<platform::UserId, uint32_t> recorded_;  // Guarded by mu_: entries per uid
  PeerCredentials every_connection_;                         // Guarded by mu_.
  bool has_every_connection_ = false;                        // Guarded by mu_.
};

}  // namespace trainstream::daemon
