// UnixListener: the daemon's listening socket. It binds the path (refusing when
// another daemon answers there, replacing a stale file nobody listens on),
// accepts connections itself, reads the peer's credentials and hands each fd to
// gRPC (see Note [Peer credentials for fd channels] in peer_credentials.h).
#pragma once

#include <grpcpp/support/status.h>
#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>

namespace grpc {
class Server;
}

namespace trainstream::daemon {

struct PeerCredentials;

class UnixListener {
 public:
  // Called on the accept thread for each new connection, before its fd is handed
  // to gRPC. Return false to close the connection instead.
  using OnAccept = std::function<bool(int fd, const PeerCredentials& creds)>;

  ~UnixListener();
  UnixListener(const UnixListener&) = delete;
  UnixListener& operator=(const UnixListener&) = delete;

  // Creates the socket's directory if missing, takes `<path>.lock` (flock), and
  // binds `path` with `mode`, group `gid` when gid != -1 (root only).
  // FAILED_PRECONDITION when another daemon serves the path.
  static grpc::Status Bind(const std::string& path, mode_t mode, gid_t gid,
                           std::unique_ptr<UnixListener>* out);

  // Starts the accept thread; accepted fds go to `server`, which must outlive
  // Stop().
  void Start(grpc::Server* server, OnAccept on_accept);
  // Stops accepting and joins the accept thread. Idempotent.
  void Stop();
  // Removes the socket and lock files (after Stop). Idempotent.
  void RemoveFiles();

  const std::string& path() const { return path_; }
  uint64_t accepted() const { return accepted_.load(); }

 private:
  UnixListener() = default;
  void AcceptLoop(grpc::Server* server, OnAccept on_accept);

  std::string path_;
  int listen_fd_ = -1;
  int lock_fd_ = -1;
  int stop_fd_ = -1;  // eventfd that wakes the accept loop
  std::thread thread_;
  std::atomic<uint64_t> accepted_{0};
  bool files_removed_ = false;
};

}  // namespace trainstream::daemon
