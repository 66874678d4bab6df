#include "transport/control_server.h"

#include <grpcpp/grpcpp.h>

#include <utility>

#include "transport/control_service.h"

namespace trainstream::daemon {

struct ControlServer::Impl {
  Impl(const DaemonConfig& config, const AccessPolicy* policy, PeerTable* peers,
       SessionRegistry* registry, Budget* budget, DaemonState* state, base::BaseCache* bases)
      : service(config, policy, peers, registry, budget, state, bases) {}
  ControlService service;
  std::unique_ptr<grpc::Server> server;  // declared last: stops before the service goes
  bool shut_down = false;
};

Status ControlServer::Start(const DaemonConfig& config, ControlListener* listener,
                            const AccessPolicy* policy, PeerTable* peers, SessionRegistry* registry,
                            Budget* budget, DaemonState* state, base::BaseCache* bases,
                            std::unique_ptr<ControlServer>* out) {
  auto impl = std::make_unique<Impl>(config, policy, peers, registry, budget, state, bases);
  grpc::ServerBuilder builder;
  builder.RegisterService(&impl->service);
  listener->AddTo(&builder);
  impl->server = builder.BuildAndStart();
  if (!impl->server) return Status(StatusCode::kUnavailable, "cannot start the gRPC server");
  out->reset(new ControlServer(std::move(impl)));
  return Status::Ok();
}

ControlServer::ControlServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

ControlServer::~ControlServer() { Shutdown(std::chrono::milliseconds(0)); }

Status ControlServer::Accept(ControlListener* listener, ControlListener::OnAccept on_accept) {
  return listener->Start(impl_->server.get(), std::move(on_accept));
}

void ControlServer::Shutdown(std::chrono::milliseconds grace) {
  if (impl_->shut_down) return;
  impl_->shut_down = true;
  impl_->server->Shutdown(std::chrono::system_clock::now() + grace);
  impl_->server->Wait();
}

}  // namespace trainstream::daemon
