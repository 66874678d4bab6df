// ControlService: the gRPC handlers of trainstream.v1.Control. One dispatch
// point per RPC: authorise the caller from its connection's credentials, hand
// the request to one SessionRegistry method, answer. Bad input is answered with
// INVALID_ARGUMENT naming the field; no client input can crash the daemon.
//
// The layers below answer with trainstream::Status; the handlers convert it to
// the gRPC status they return, and nowhere else does (Note [One Status below
// the transport], trainstream/status.h).
#pragma once

#include <cstdint>
#include <string>

#include "base/base_cache.h"
#include "memory/budget.h"
#include "process/config.h"
#include "process/daemon_state.h"
#include "sessions/session_registry.h"
#include "trainstream/grpc_status.h"
#include "trainstream/status.h"
#include "trainstream/v1/control.grpc.pb.h"
#include "transport/control_server.h"
#include "transport/peer_credentials.h"

namespace trainstream::daemon {

class ControlService final : public v1::Control::Service {
 public:
  // Every pointer must be non-null and outlive the service (and the gRPC server
  // using it).
  ControlService(const DaemonConfig& config, const AccessPolicy* policy, PeerTable* peers,
                 SessionRegistry* registry, Budget* budget, DaemonState* state,
                 base::BaseCache* bases)
      : config_(config),
        policy_(policy),
        peers_(peers),
        registry_(registry),
        budget_(budget),
        state_(state),
        bases_(bases) {}

  grpc::Status Ping(grpc::ServerContext* ctx, const v1::PingRequest* req,
                    v1::PingResponse* resp) override;
  grpc::Status Attach(
      grpc::ServerContext* ctx,
      grpc::ServerReaderWriter<v1::SessionEvent, v1::SessionMessage>* stream) override;
  grpc::Status RegisterParameters(grpc::ServerContext* ctx,
                                  const v1::RegisterParametersRequest* req,
                                  v1::RegisterParametersResponse* resp) override;
  grpc::Status AllocateRegion(grpc::ServerContext* ctx, const v1::AllocateRegionRequest* req,
                              v1::AllocateRegionResponse* resp) override;
  grpc::Status FreeRegion(grpc::ServerContext* ctx, const v1::FreeRegionRequest* req,
                          v1::FreeRegionResponse* resp) override;
  grpc::Status Status(grpc::ServerContext* ctx, const v1::StatusRequest* req,
                      v1::StatusResponse* resp) override;
  grpc::Status Shutdown(grpc::ServerContext* ctx, const v1::ShutdownRequest* req,
                        v1::ShutdownResponse* resp) override;

  // Frozen bases (control_service_base.cc).
  grpc::Status LoadBase(grpc::ServerContext* ctx, const v1::LoadBaseRequest* req,
                        grpc::ServerWriter<v1::LoadBaseEvent>* writer) override;
  grpc::Status ReleaseBase(grpc::ServerContext* ctx, const v1::ReleaseBaseRequest* req,
                           v1::ReleaseBaseResponse* resp) override;
  grpc::Status ListBases(grpc::ServerContext* ctx, const v1::ListBasesRequest* req,
                         v1::ListBasesResponse* resp) override;
  grpc::Status DropBase(grpc::ServerContext* ctx, const v1::DropBaseRequest* req,
                        v1::DropBaseResponse* resp) override;
  grpc::Status ShareBaseVram(grpc::ServerContext* ctx, const v1::ShareBaseVramRequest* req,
                             v1::ShareBaseVramResponse* resp) override;

 private:
  // The caller's credentials, or PERMISSION_DENIED saying who may connect.
  grpc::Status Authorize(grpc::ServerContext* ctx, PeerCredentials* creds);

  // The idiom of every session request: authorise the caller, find the session
  // its id and token name (it must be the caller's), then run
  // fn(creds, session) and answer what it returns (a trainstream::Status).
  template <typename Request, typename Fn>
  grpc::Status WithSession(grpc::ServerContext* ctx, const Request& req, Fn fn) {
    PeerCredentials creds;
    if (auto s = Authorize(ctx, &creds); !s.ok()) return s;
    std::shared_ptr<Session> session;
    if (auto s = registry_->Find(req.session_id(), req.session_token(), creds, &session); !s.ok())
      return ToGrpc(s);
    return ToGrpc(fn(creds, *session));
  }
  // Adds the cached bases (and their segments) to a status answer.
  void FillBaseStatus(v1::StatusResponse* resp);

  const DaemonConfig config_;
  const AccessPolicy* policy_;
  PeerTable* peers_;
  SessionRegistry* registry_;
  Budget* budget_;
  DaemonState* state_;
  base::BaseCache* const bases_;
};

}  // namespace trainstream::daemon
