// The Windows side of transport/control_listener.h: gRPC on loopback TCP, an
// endpoint file with the port and a secret.
//
// Note [The Windows daemon on loopback TCP]: gRPC 1.51 has no unix: addresses
// and no fd channels on Windows, and Wine 8.0 no AF_UNIX (docs/windows.md,
// "The socket and peer identity on Windows"). So gRPC owns a listening socket
// on 127.0.0.1 at a port the system picks, and the daemon writes that port
// with a fresh secret to the endpoint file, which only its user can read
// (platform/endpoint.h). Clients read the file and send the secret with every
// call; ControlService::Authorize refuses a call without it before anything
// else, so a call that passes is the daemon's own user's
// (Note [Callers without a connection identity], peer_credentials.h). The
// lock file keeps a second daemon of the same endpoint from starting.
#include <grpcpp/grpcpp.h>
#include <spdlog/spdlog.h>

#include <cerrno>
#include <cstring>

#include "trainstream/platform/endpoint.h"
#include "trainstream/platform/files.h"
#include "trainstream/platform/sys_call.h"
#include "trainstream/platform/user.h"
#include "transport/control_listener.h"
#include "transport/peer_credentials.h"

namespace trainstream::daemon {
namespace {

std::string FolderOf(const std::string& path) {
  const size_t slash = path.find_last_of("\\/");
  return slash == std::string::npos ? std::string() : path.substr(0, slash);
}

}  // namespace

Status ControlListener::Bind(const std::string& path, mode_t, platform::GroupId,
                             std::unique_ptr<ControlListener>* out) {
  std::unique_ptr<ControlListener> l(new ControlListener());
  if (const std::string folder = FolderOf(path); !folder.empty()) {
    if (int err = platform::MakeDirectories(folder); err != 0) {
      return platform::ErrnoStatus(StatusCode::kPermissionDenied, "cannot create " + folder, err);
    }
  }
  const std::string lock_path = path + ".lock";
  if (int err = platform::LockFile(lock_path, &l->lock_handle_); err != 0) {
    l->lock_handle_ = -1;
    if (err == EWOULDBLOCK) {
      return Status(StatusCode::kFailedPrecondition,
                    "another trainstreamd is already serving " + path +
                        "; stop it first (`trainstreamctl --socket " + path +
                        " shutdown`, or `sc stop` for the service) or choose another --socket");
    }
    return platform::ErrnoStatus(StatusCode::kPermissionDenied, "cannot open " + lock_path, err);
  }
  if (int err = platform::NewEndpointSecret(&l->secret_); err != 0) {
    return platform::ErrnoStatus(StatusCode::kInternal, "cannot draw the endpoint secret", err);
  }
  l->path_ = path;
  *out = std::move(l);
  return Status::Ok();
}

void ControlListener::AddTo(grpc::ServerBuilder* builder) {
  builder->AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
}

Status ControlListener::Start(grpc::Server*, OnAccept on_accept) {
  if (port_ <= 0) {
    return Status(StatusCode::kUnavailable, "gRPC could not listen on 127.0.0.1");
  }
  PeerCredentials daemon_user;
  daemon_user.uid = platform::CurrentUserId();
  if (std::string refusal = on_accept(PeerTable::kEveryConnection, daemon_user); !refusal.empty())
    return Status(StatusCode::kInternal, refusal);
  platform::Endpoint endpoint{"127.0.0.1:" + std::to_string(port_), secret_};
  if (int err = platform::WriteEndpointFile(path_, endpoint); err != 0) {
    return platform::ErrnoStatus(StatusCode::kPermissionDenied,
                                 "cannot write the endpoint file " + path_, err);
  }
  accepted_.store(1);
  return Status::Ok();
}

void ControlListener::Stop() {}

void ControlListener::RemoveFiles() {
  if (files_removed_ || path_.empty()) return;
  files_removed_ = true;
  platform::RemoveFile(path_);
  if (lock_handle_ != -1) platform::UnlockFile(lock_handle_);
  lock_handle_ = -1;
  platform::RemoveFile(path_ + ".lock");
}

ControlListener::~ControlListener() {
  Stop();
  RemoveFiles();
  if (lock_handle_ != -1) platform::UnlockFile(lock_handle_);
}

}  // namespace trainstream::daemon
