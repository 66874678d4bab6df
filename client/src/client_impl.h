// Internal state behind Client and Session (not part of the public API).
#pragma once

#include <grpcpp/grpcpp.h>

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "trainstream/client.h"
#include "trainstream/platform/control_channel.h"
#include "trainstream/v1/control.grpc.pb.h"

namespace trainstream {

// Every call's context goes through PrepareCall: its deadline, and the
// endpoint secret where the system needs one (platform/control_channel.h).
void PrepareCall(const platform::ControlTarget& target, grpc::ClientContext* ctx, int seconds);

struct Client::Impl {
  std::string socket_path;  // the endpoint: a socket (Linux), an endpoint file (Windows)
  platform::ControlTarget target;
  std::shared_ptr<grpc::Channel> channel;  // shared with every Session of this client
  std::unique_ptr<v1::Control::Stub> stub;
};

struct Session::Impl {
  std::string socket_path;
  platform::ControlTarget target;
  std::shared_ptr<grpc::Channel> channel;  // keeps the connection up while the session lives
  std::unique_ptr<v1::Control::Stub> stub;
  grpc::ClientContext stream_context;
  std::unique_ptr<grpc::ClientReaderWriter<v1::SessionMessage, v1::SessionEvent>> stream;

  uint64_t id = 0;
  std::string token;
  std::string recovery_token;
  std::unique_ptr<ResumedState> resumed;
  std::string shm_dir;
  std::unique_ptr<MappedRegion> control;
  double group_timeout_s = 0;  // group sessions: how long registration may wait

  std::thread reader;  // reads daemon events until the stream ends
  mutable std::mutex mu;
  bool alive = true;                   // Guarded by mu.
  std::string why;                     // Guarded by mu: why the session ended (or a drain notice)
  bool detached = false;               // Guarded by mu.
  SessionEnd end = SessionEnd::kNone;  // Guarded by mu.

  void ReadEvents();
};

}  // namespace trainstream
