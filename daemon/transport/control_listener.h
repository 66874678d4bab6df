// ControlListener: where the daemon's control server takes its connections.
// One header, one source file per system (daemon/CMakeLists.txt picks it):
//
// Linux (unix_listener.cc): the unix socket. It binds the path (refusing when
// another daemon answers there, replacing a stale file nobody listens on),
// accepts connections itself, reads the peer's credentials and hands each fd to
// gRPC (see Note [Peer credentials for fd channels] in peer_credentials.h).
// AddTo adds nothing; the secret is empty.
//
// Windows (loopback_listener.cc; Note [The Windows daemon on loopback TCP]):
// gRPC 1.51 has neither unix sockets nor fd channels there, so gRPC owns a
// socket on 127.0.0.1, a port the system picks (AddTo, before the server
// starts). Start writes the endpoint file (its path is the daemon's socket
// path): the port and a fresh secret, owner-only (platform/endpoint.h). Every
// call must carry that secret (ControlService::Authorize); a call that does is
// the daemon's own user (PeerTable::kEveryConnection).
//
// Note [Accepting under a connection flood]: a client that opens connections
// and never closes them must not wedge the daemon (1,140 idle connections
// against 1,024 fds spun the accept loop on EMFILE at 99.7% CPU and wrote
// 411 MB of log in 8 s). Three defences: OnAccept refuses a uid over its
// connection cap, so one user cannot take the fds (PeerTable::Admit); on EMFILE
// or ENFILE the loop frees its reserve fd, accepts and closes what is waiting
// (so the clients fail at once instead of timing out, and poll() stops
// reporting it), takes the reserve back and does not poll the socket again for
// kEmfileBackoffMs; and every line the loop logs about a connection is rate
// limited. Connections already handed to gRPC are served throughout.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "trainstream/platform/user.h"
#include "trainstream/status.h"

namespace grpc {
class Server;
class ServerBuilder;
}  // namespace grpc

namespace trainstream::daemon {

struct PeerCredentials;

class ControlListener {
 public:
  // Called on the accept thread for each new connection, before its fd is handed
  // to gRPC. Returns "" to hand it on, else why it is closed instead (logged,
  // rate limited, with the peer's uid and pid). Windows: called once, from
  // Start, with fd PeerTable::kEveryConnection and the daemon's own user.
  using OnAccept = std::function<std::string(int fd, const PeerCredentials& creds)>;

  // How long the loop leaves the socket alone after EMFILE/ENFILE.
  static constexpr int kEmfileBackoffMs = 100;

  ~ControlListener();
  ControlListener(const ControlListener&) = delete;
  ControlListener& operator=(const ControlListener&) = delete;

  // Creates the socket's directory if missing, takes `<path>.lock` (flock), and
  // binds `path` with `mode`, group `gid` when gid != -1 (root only).
  // FAILED_PRECONDITION when another daemon serves the path. Windows: the
  // folder and the lock file alike (the lock is the open file, shared with
  // nobody); `path` is the endpoint file; `mode` and `gid` are not used.
  static Status Bind(const std::string& path, mode_t mode, platform::GroupId gid,
                     std::unique_ptr<ControlListener>* out);

  // What every call must carry (platform/control_channel.h): "" on Linux, the
  // endpoint file's secret on Windows. Set by Bind.
  const std::string& secret() const { return secret_; }

  // Called with the server's builder before it starts. Linux: nothing.
  // Windows: the loopback port.
  void AddTo(grpc::ServerBuilder* builder);

  // Starts serving `server`, which must outlive Stop(). Linux: the accept
  // thread; accepted fds go to `server`. Windows: writes the endpoint file.
  // INTERNAL when the file cannot be written.
  Status Start(grpc::Server* server, OnAccept on_accept);
  // Stops accepting and joins the accept thread. Idempotent.
  void Stop();
  // Removes the socket (Windows: endpoint) and lock files (after Stop). Idempotent.
  void RemoveFiles();

  const std::string& path() const { return path_; }
  uint64_t accepted() const { return accepted_.load(); }

 private:
  ControlListener() = default;
  void AcceptLoop(grpc::Server* server, OnAccept on_accept);
  // Out of fds: closes the reserve, accepts and closes up to a backlog's worth
  // of waiting connections, reopens the reserve. Returns how many it closed.
  int ShedWaitingConnections();

  std::string path_;
  std::string secret_;
  int port_ = 0;               // Windows: the port gRPC picked
  intptr_t lock_handle_ = -1;  // Windows: the open lock file
  int listen_fd_ = -1;
  int lock_fd_ = -1;
  int stop_fd_ = -1;     // eventfd that wakes the accept loop
  int reserve_fd_ = -1;  // /dev/null, given up for an accept() when out of fds
  std::thread thread_;
  std::atomic<uint64_t> accepted_{0};
  bool files_removed_ = false;
};

}  // namespace trainstream::daemon
