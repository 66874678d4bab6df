// ControlServer: the gRPC server that answers trainstream.v1.Control on the
// connections a ControlListener accepts. The process (process/daemon.cc) starts
// and stops it through this header, which names no gRPC type (Note [One Status
// below the transport], trainstream/status.h).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>

#include "memory/budget.h"
#include "process/config.h"
#include "process/daemon_state.h"
#include "sessions/session_registry.h"
#include "trainstream/status.h"
#include "transport/control_listener.h"
#include "transport/peer_credentials.h"

namespace trainstream::daemon {

namespace base {
class BaseCache;
}

inline constexpr const char* kDaemonVersion = "0.1.0";
inline constexpr uint32_t kProtocolVersion = 1;

class ControlServer {
 public:
  // Starts the server over a ControlService of these parts, with what
  // `listener` adds to it (ControlListener::AddTo); every pointer must be
  // non-null and outlive the server. UNAVAILABLE when gRPC cannot start.
  static Status Start(const DaemonConfig& config, ControlListener* listener,
                      const AccessPolicy* policy, PeerTable* peers, SessionRegistry* registry,
                      Budget* budget, DaemonState* state, base::BaseCache* bases,
                      std::unique_ptr<ControlServer>* out);
  ControlServer(const ControlServer&) = delete;
  ControlServer& operator=(const ControlServer&) = delete;
  ~ControlServer();

  // Starts `listener` (its accept thread on Linux): its connections are served
  // here. The server must outlive listener->Stop(). Its error, if any.
  Status Accept(ControlListener* listener, ControlListener::OnAccept on_accept);
  // Waits up to `grace` for calls in flight, cancels the rest, and returns once
  // every handler has. Idempotent.
  void Shutdown(std::chrono::milliseconds grace);

 private:
  struct Impl;
  explicit ControlServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace trainstream::daemon
