// The Linux side of the control channel's seam
// (trainstream/platform/control_channel.h): the endpoint is the daemon's unix
// socket, and the kernel names the peer, so calls carry no secret. What a
// socket path's permissions and a plain connect() say about it is the client's
// old socket_path.cc, moved.
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <pwd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "trainstream/platform/control_channel.h"
#include "trainstream/platform/sys_call.h"

namespace trainstream::platform {
namespace {

std::string GroupName(gid_t gid) {
  group gr{};
  group* found = nullptr;
  std::vector<char> buf(16384);
  if (getgrgid_r(gid, &gr, buf.data(), buf.size(), &found) == 0 && found != nullptr)
    return found->gr_name;
  return std::to_string(gid);
}

std::string UserName(uid_t uid) {
  passwd pw{};
  passwd* found = nullptr;
  std::vector<char> buf(16384);
  if (getpwuid_r(uid, &pw, buf.data(), buf.size(), &found) == 0 && found != nullptr)
    return found->pw_name;
  return std::to_string(uid);
}

std::string Mode(mode_t mode) {
  char buf[8];
  std::snprintf(buf, sizeof(buf), "%04o", static_cast<unsigned>(mode & 07777));
  return buf;
}

std::string Parent(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

const char kOtherDaemon[] =
    "or set TRAINSTREAM_SOCKET to the socket of a trainstreamd you may use (or unset it to use "
    "your own embedded daemon)";

}  // namespace

std::string DescribeEndpointAccessDenied(const std::string& socket_path) {
  // connect() needs write permission on the socket and search permission on
  // every directory above it, for the effective ids (AT_EACCESS).
  if (faccessat(AT_FDCWD, socket_path.c_str(), W_OK, AT_EACCESS) == 0 || errno != EACCES) return "";
  const std::string who = "uid " + std::to_string(geteuid()) + " (" + UserName(geteuid()) + ")";
  struct stat st {};
  if (stat(socket_path.c_str(), &st) != 0) {
    // A directory on the way keeps us out: name the first one that does.
    std::string dir = Parent(socket_path);
    for (std::string up = dir; up != "/" && up != "."; up = Parent(up)) {
      if (faccessat(AT_FDCWD, up.c_str(), X_OK, AT_EACCESS) != 0) dir = up;
    }
    struct stat ds {};
    std::string owner;
    if (stat(dir.c_str(), &ds) == 0) {
      owner = " (mode " + Mode(ds.st_mode) + ", owner " + UserName(ds.st_uid) + ", group " +
              GroupName(ds.st_gid) + ")";
    }
    return "trainstreamd's socket " + socket_path + " is not reachable for " + who +
           ": permission denied on the directory " + dir + owner +
           "; ask its owner for access (e.g. join group '" + GroupName(ds.st_gid) + "'), " +
           kOtherDaemon;
  }
  const std::string group = GroupName(st.st_gid);
  return "trainstreamd's socket " + socket_path + " exists, but " + who +
         " may not connect to it: permission denied (mode " + Mode(st.st_mode) + ", owner " +
         UserName(st.st_uid) + ", group " + group + "). Join group '" + group +
         "' (`sudo usermod -aG " + group + " " + UserName(geteuid()) +
         "`, then log in again; the daemon must also allow that group: allow_group), " +
         kOtherDaemon;
}

std::string DescribeEndpointUnreachable(const std::string& socket_path, bool* closed_at_once) {
  *closed_at_once = false;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (socket_path.size() >= sizeof(addr.sun_path)) return "the socket path is too long";
  std::memcpy(addr.sun_path, socket_path.c_str(), socket_path.size());
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return ErrnoText("cannot create a socket here", errno);
  const int rc = connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  const int err = rc == 0 ? 0 : errno;
  std::string why;
  if (err == ENOENT) {
    why = "the socket does not exist (is trainstreamd running? start it with `trainstreamd`)";
  } else if (err == ECONNREFUSED) {
    why =
        "nothing listens on it (a stale socket: trainstreamd is not running; start it with "
        "`trainstreamd`)";
  } else if (err == EACCES || err == EPERM) {
    why = DescribeEndpointAccessDenied(socket_path);
    if (why.empty()) why = ErrnoText("connect", err);
  } else if (err == EAGAIN) {
    why =
        "trainstreamd's queue of connections waiting to be accepted is full (it is overloaded, "
        "or many connections are being opened at once); try again";
  } else if (err != 0) {
    why = ErrnoText("connect", err);
  } else {
    // The daemon accepted. One that closes at once is refusing this uid (over
    // max_connections_per_uid) or out of file descriptors; wait briefly to see.
    pollfd p{fd, POLLIN, 0};
    char byte = 0;
    const bool closed = poll(&p, 1, 200) == 1 && (p.revents & (POLLHUP | POLLIN)) != 0 &&
                        recv(fd, &byte, 1, MSG_PEEK) <= 0;
    *closed_at_once = closed;
    why = closed ? "trainstreamd accepted the connection and closed it at once: this uid holds "
                   "as many connections as the daemon allows (max_connections_per_uid), or the "
                   "daemon is out of file descriptors; see the daemon's log"
                 : "trainstreamd accepts connections but did not complete the gRPC handshake "
                   "(it may be overloaded; see its log)";
  }
  close(fd);
  return why;
}

std::string EmbeddedControlEndpoint() {
  if (const char* xdg = std::getenv("XDG_RUNTIME_DIR"); xdg != nullptr && *xdg != '\0') {
    return std::string(xdg) + "/trainstream/trainstreamd.sock";
  }
  return "/tmp/trainstream-" + std::to_string(geteuid()) + "/trainstreamd.sock";
}

std::string DefaultControlEndpoint() {
  if (const char* env = std::getenv("TRAINSTREAM_SOCKET"); env != nullptr && *env != '\0')
    return env;
  static const char kSystem[] = "/run/trainstream/trainstreamd.sock";
  struct stat st {};
  if (stat(kSystem, &st) == 0 && S_ISSOCK(st.st_mode)) return kSystem;
  // A system daemon whose directory keeps this uid out is still the one to use:
  // Connect() then says which group to join instead of starting another.
  if (errno == EACCES) return kSystem;
  return EmbeddedControlEndpoint();
}

std::string DefaultDaemonEndpoint() {
  if (const char* env = std::getenv("TRAINSTREAM_SOCKET"); env != nullptr && *env != '\0') {
    return env;
  }
  if (geteuid() == 0) return "/run/trainstream/trainstreamd.sock";
  return EmbeddedControlEndpoint();
}

int ResolveControlTarget(const std::string& endpoint, ControlTarget* out, std::string*) {
  out->grpc_target = "unix:" + endpoint;
  out->secret.clear();
  return 0;
}

}  // namespace trainstream::platform
