#include "transport/peer_credentials.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <utility>

#include "trainstream/platform/socket_peer.h"
#include "trainstream/platform/user.h"

namespace trainstream::daemon {

bool ReadPeerCredentials(int fd, PeerCredentials* out) {
  platform::SocketPeer peer;
  if (const int err = platform::ReadSocketPeer(fd, &peer); err != 0) {
    errno = err;  // the caller names it
    return false;
  }
  out->pid = static_cast<pid_t>(peer.pid);
  out->uid = peer.uid;
  out->gid = peer.gid;
  out->groups = std::move(peer.groups);
  return true;
}

namespace {
bool ResolveGroup(const std::string& name, platform::GroupId* gid, std::string* error) {
  if (platform::LookupGroup(name, gid) == 0) return true;
  // A numeric gid is accepted too.
  char* end = nullptr;
  unsigned long v = std::strtoul(name.c_str(), &end, 10);
  if (!name.empty() && end != nullptr && *end == '\0') {
    *gid = static_cast<platform::GroupId>(v);
    return true;
  }
  *error =
      "unknown group '" + name + "' (create it with `groupadd " + name + "` or fix the setting)";
  return false;
}
}  // namespace

bool AccessPolicy::Resolve(const std::string& allow_group, const std::string& admin_group,
                           std::string* error) {
  daemon_uid_ = platform::CurrentUserId();
  if (!allow_group.empty()) {
    if (!ResolveGroup(allow_group, &allow_gid_, error)) return false;
    allow_gid_set_ = true;
  }
  if (!admin_group.empty()) {
    if (!ResolveGroup(admin_group, &admin_gid_, error)) return false;
    admin_gid_set_ = true;
  }
  return true;
}

bool AccessPolicy::InGroup(const PeerCredentials& c, platform::GroupId g) {
  return c.gid == g || std::find(c.groups.begin(), c.groups.end(), g) != c.groups.end();
}

void AccessPolicy::Apply(PeerCredentials* c) const {
  const bool owner = c->uid == 0 || c->uid == daemon_uid_;
  c->admin = owner || (admin_gid_set_ && InGroup(*c, admin_gid_));
  c->allowed = c->admin || (allow_gid_set_ && InGroup(*c, allow_gid_));
}

void PeerTable::Set(int fd, const PeerCredentials& creds) {
  uint32_t ignored = 0;
  Admit(fd, creds, 0, &ignored);
}

bool PeerTable::Admit(int fd, const PeerCredentials& creds, uint32_t max_per_uid, uint32_t* live) {
  if (fd == kEveryConnection) {
    std::lock_guard<std::mutex> lock(mu_);
    every_connection_ = creds;
    has_every_connection_ = true;
    *live = 0;
    return true;
  }
  uint64_t dev = 0, ino = 0;
  const bool identified = platform::DescriptorIdentity(fd, &dev, &ino) == 0;
  std::lock_guard<std::mutex> lock(mu_);
  // The number may still name a connection gRPC closed: that entry goes first.
  if (auto it = by_fd_.find(fd); it != by_fd_.end()) {
    --recorded_[it->second.creds.uid];
    by_fd_.erase(it);
  }
  if (max_per_uid != 0 && recorded_[creds.uid] >= max_per_uid) {
    *live = PruneAndCountLocked(creds.uid);
    if (*live >= max_per_uid) return false;
  }
  Entry& e = by_fd_[fd];
  e.creds = creds;
  e.dev = identified ? dev : 0;
  e.ino = identified ? ino : 0;
  *live = ++recorded_[creds.uid];
  return true;
}

uint32_t PeerTable::PruneAndCountLocked(platform::UserId uid) {
  uint32_t count = 0;
  for (auto it = by_fd_.begin(); it != by_fd_.end();) {
    if (it->second.creds.uid != uid) {
      ++it;
      continue;
    }
    uint64_t dev = 0, ino = 0;
    if (platform::DescriptorIdentity(it->first, &dev, &ino) == 0 && dev == it->second.dev &&
        ino == it->second.ino) {
      ++count;
      ++it;
    } else {
      it = by_fd_.erase(it);
    }
  }
  recorded_[uid] = count;
  return count;
}

uint32_t PeerTable::LiveConnections(platform::UserId uid) {
  std::lock_guard<std::mutex> lock(mu_);
  return PruneAndCountLocked(uid);
}

bool PeerTable::Lookup(const std::string& peer, PeerCredentials* out) const {
  if (LookupFd(peer, out)) return true;
  // Note [Callers without a connection identity].
  std::lock_guard<std::mutex> lock(mu_);
  if (!has_every_connection_) return false;
  *out = every_connection_;
  return true;
}

bool PeerTable::LookupFd(const std::string& peer, PeerCredentials* out) const {
  // "fd:12" (see Note [Peer credentials for fd channels]).
  size_t colon = peer.rfind(':');
  if (colon == std::string::npos || peer.compare(0, 3, "fd:") != 0) return false;
  char* end = nullptr;
  long fd = std::strtol(peer.c_str() + colon + 1, &end, 10);
  if (end == peer.c_str() + colon + 1 || *end != '\0') return false;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = by_fd_.find(static_cast<int>(fd));
  if (it == by_fd_.end()) return false;
  *out = it->second.creds;
  return true;
}

}  // namespace trainstream::daemon
