// The Linux side of transport/control_listener.h: the unix socket.
#include <fcntl.h>
#include <grpcpp/server.h>
#include <grpcpp/server_posix.h>
#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/eventfd.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>

#include "logging/log_limiter.h"
#include "trainstream/platform/sys_call.h"
#include "trainstream/platform/user.h"
#include "transport/control_listener.h"
#include "transport/peer_credentials.h"

namespace trainstream::daemon {
namespace {

constexpr int kListenBacklog = 128;

Status Fail(StatusCode code, const std::string& msg) { return Status(code, msg); }

bool MakeAddress(const std::string& path, sockaddr_un* addr) {
  std::memset(addr, 0, sizeof(*addr));
  addr->sun_family = AF_UNIX;
  if (path.size() >= sizeof(addr->sun_path)) return false;
  std::memcpy(addr->sun_path, path.c_str(), path.size());
  return true;
}

// mkdir -p of the socket's directory. New directories get 0755 (the socket's own
// mode is what restricts access).
bool MakeParentDirs(const std::string& path, std::string* error) {
  for (size_t pos = 1; (pos = path.find('/', pos)) != std::string::npos; ++pos) {
    std::string dir = path.substr(0, pos);
    if (mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) {
      const int err = errno;
      *error = platform::ErrnoText("cannot create " + dir, err);
      return false;
    }
  }
  return true;
}

// Is a daemon answering on `path`? Sets *pid to its pid when it is.
bool SomeoneListens(const std::string& path, pid_t* pid) {
  sockaddr_un addr;
  if (!MakeAddress(path, &addr)) return false;
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  bool live = connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  if (live) {
    struct ucred cred {};
    socklen_t len = sizeof(cred);
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0) *pid = cred.pid;
  }
  close(fd);
  return live;
}

}  // namespace

Status ControlListener::Bind(const std::string& path, mode_t mode, platform::GroupId gid,
                             std::unique_ptr<ControlListener>* out) {
  std::unique_ptr<ControlListener> l(new ControlListener());
  sockaddr_un addr;
  if (!MakeAddress(path, &addr)) {
    return Fail(
        StatusCode::kInvalidArgument,
        "socket path too long (" + std::to_string(path.size()) + " bytes, max 107): " + path);
  }
  std::string error;
  if (!MakeParentDirs(path, &error)) return Fail(StatusCode::kPermissionDenied, error);

  // The lock file serialises two daemons starting at the same moment; the
  // connect() probe below catches a live daemon that lost its lock file.
  const std::string lock_path = path + ".lock";
  l->lock_fd_ = open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (l->lock_fd_ < 0) {
    const int err = errno;
    return platform::ErrnoStatus(StatusCode::kPermissionDenied, "cannot open " + lock_path, err);
  }
  pid_t other = 0;
  const bool locked = flock(l->lock_fd_, LOCK_EX | LOCK_NB) == 0;
  const bool live = SomeoneListens(path, &other);
  if (!locked || live) {
    std::string who = other > 0 ? " (pid " + std::to_string(other) + ")" : "";
    close(l->lock_fd_);
    l->lock_fd_ = -1;
    return Fail(StatusCode::kFailedPrecondition,
                "another trainstreamd" + who + " is already serving " + path +
                    "; stop it first (`trainstreamctl --socket " + path +
                    " shutdown`) or choose another --socket");
  }
  struct stat st {};
  if (lstat(path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      close(l->lock_fd_);
      l->lock_fd_ = -1;
      return Fail(StatusCode::kFailedPrecondition,
                  path + " exists and is not a socket; refusing to replace it");
    }
    spdlog::warn("replacing stale socket {} (nothing listens on it)", path);
    unlink(path.c_str());
  }
  l->path_ = path;

  l->listen_fd_ = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (l->listen_fd_ < 0) {
    const int err = errno;
    return platform::ErrnoStatus(StatusCode::kInternal, "socket", err);
  }
  // Bind under a restrictive umask so there is no window with a wider mode.
  mode_t old_umask = umask(0177);
  int rc = bind(l->listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  int bind_errno = errno;
  umask(old_umask);
  if (rc != 0) {
    return platform::ErrnoStatus(StatusCode::kPermissionDenied, "cannot bind " + path, bind_errno);
  }
  if (gid != static_cast<platform::GroupId>(-1) &&
      chown(path.c_str(), static_cast<platform::UserId>(-1), gid) != 0) {
    const int err = errno;
    spdlog::warn("cannot give {} to gid {}: {}", path, gid, platform::ErrnoMessage(err));
  }
  if (chmod(path.c_str(), mode) != 0) {
    const int err = errno;
    return platform::ErrnoStatus(StatusCode::kInternal, "chmod " + path, err);
  }
  if (listen(l->listen_fd_, kListenBacklog) != 0) {
    const int err = errno;
    return platform::ErrnoStatus(StatusCode::kInternal, "listen " + path, err);
  }
  l->stop_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  l->reserve_fd_ = open("/dev/null", O_RDONLY | O_CLOEXEC);
  *out = std::move(l);
  return Status::Ok();
}

void ControlListener::AddTo(grpc::ServerBuilder*) {}

Status ControlListener::Start(grpc::Server* server, OnAccept on_accept) {
  thread_ = std::thread([this, server, on_accept] { AcceptLoop(server, on_accept); });
  return Status::Ok();
}

void ControlListener::AcceptLoop(grpc::Server* server, OnAccept on_accept) {
  // Note [Accepting under a connection flood].
  LogLimiter out_of_fds_log(3, std::chrono::seconds(5));
  LogLimiter refused_log(5, std::chrono::seconds(5));
  LogLimiter error_log(3, std::chrono::seconds(5));
  uint64_t suppressed = 0;
  auto and_suppressed = [&suppressed] {
    return suppressed == 0 ? std::string()
                           : " (" + std::to_string(suppressed) + " similar lines not logged)";
  };
  bool backing_off = false;
  for (;;) {
    // A negative fd is ignored by poll(): while backing off only stop_fd_ counts.
    pollfd fds[2] = {{backing_off ? -1 : listen_fd_, POLLIN, 0}, {stop_fd_, POLLIN, 0}};
    int n = poll(fds, 2, backing_off ? kEmfileBackoffMs : -1);
    if (n < 0) {
      const int err = errno;
      if (err == EINTR) continue;
      spdlog::error("accept loop: poll: {}", platform::ErrnoMessage(err));
      return;
    }
    if (fds[1].revents != 0) return;
    if (backing_off) {
      backing_off = false;
      if (reserve_fd_ < 0) reserve_fd_ = open("/dev/null", O_RDONLY | O_CLOEXEC);
      continue;
    }
    if ((fds[0].revents & POLLIN) == 0) continue;
    int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      const int err = errno;
      if (err == EMFILE || err == ENFILE) {
        const int shed = ShedWaitingConnections();
        backing_off = true;
        if (out_of_fds_log.Allow(&suppressed)) {
          rlimit lim{};
          getrlimit(RLIMIT_NOFILE, &lim);
          spdlog::warn(
              "accept on {}: {} (open-file limit {}): closed {} waiting connection(s), next "
              "accept in {} ms; sessions already attached go on. Lower max_connections_per_uid "
              "or raise the limit (systemd LimitNOFILE=){}",
              path_, platform::ErrnoMessage(err), static_cast<uint64_t>(lim.rlim_cur), shed,
              kEmfileBackoffMs, and_suppressed());
        }
      } else if (err != EAGAIN && err != EINTR && err != ECONNABORTED) {
        if (error_log.Allow(&suppressed))
          spdlog::warn("accept on {}: {}{}", path_, platform::ErrnoMessage(err), and_suppressed());
      }
      continue;
    }
    PeerCredentials creds;
    if (!ReadPeerCredentials(fd, &creds)) {
      const int err = errno;  // ReadPeerCredentials leaves the call's errno
      if (error_log.Allow(&suppressed)) {
        spdlog::warn("SO_PEERCRED failed on a new connection: {}; closing it{}",
                     platform::ErrnoMessage(err), and_suppressed());
      }
      close(fd);
      continue;
    }
    std::string refusal = on_accept(fd, creds);
    if (!refusal.empty()) {
      close(fd);
      if (refused_log.Allow(&suppressed)) {
        spdlog::warn("closed a connection from uid {} pid {}: {}{}", creds.uid, creds.pid, refusal,
                     and_suppressed());
      }
      continue;
    }
    accepted_.fetch_add(1);
    // gRPC owns the fd from here and closes it when the connection ends.
    grpc::AddInsecureChannelFromFd(server, fd);
  }
}

int ControlListener::ShedWaitingConnections() {
  if (reserve_fd_ >= 0) {
    close(reserve_fd_);
    reserve_fd_ = -1;
  }
  int shed = 0;
  for (; shed < kListenBacklog; ++shed) {
    int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) break;
    close(fd);
  }
  // Another thread may take the freed number first; the end of the back-off tries again.
  reserve_fd_ = open("/dev/null", O_RDONLY | O_CLOEXEC);
  return shed;
}

void ControlListener::Stop() {
  if (thread_.joinable()) {
    uint64_t one = 1;
    ssize_t ignored = write(stop_fd_, &one, sizeof(one));
    (void)ignored;
    thread_.join();
  }
  if (listen_fd_ >= 0) {
    close(listen_fd_);
    listen_fd_ = -1;
  }
}

void ControlListener::RemoveFiles() {
  if (files_removed_ || path_.empty()) return;
  files_removed_ = true;
  unlink(path_.c_str());
  unlink((path_ + ".lock").c_str());
}

ControlListener::~ControlListener() {
  Stop();
  RemoveFiles();
  if (stop_fd_ >= 0) close(stop_fd_);
  if (reserve_fd_ >= 0) close(reserve_fd_);
  if (lock_fd_ >= 0) close(lock_fd_);
}

}  // namespace trainstream::daemon
