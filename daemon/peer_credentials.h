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

namespace trainstream::daemon {

struct PeerCredentials {
  pid_t pid = 0;
  uid_t uid = 0;
  gid_t gid = 0;
  std::vector<gid_t> groups;  // supplementary groups (SO_PEERGROUPS)
  bool allowed = false;       // may use the daemon
  bool admin = false;         // may also shut it down
};

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
  gid_t allow_gid() const { return allow_gid_; }

 private:
  static bool InGroup(const PeerCredentials& c, gid_t g);
  uid_t daemon_uid_ = 0;
  bool allow_gid_set_ = false, admin_gid_set_ = false;
  gid_t allow_gid_ = 0, admin_gid_ = 0;
};

// fd number -> credentials of the connection on it. Thread-safe.
class PeerTable {
 public:
  void Set(int fd, const PeerCredentials& creds);
  // Looks up a ServerContext::peer() string ("fd:12"). False when unknown.
  bool Lookup(const std::string& peer, PeerCredentials* out) const;

 private:
  mutable std::mutex mu_;
  std::unordered_map<int, PeerCredentials> by_fd_;  // Guarded by mu_.
};

}  // namespace trainstream::daemon
