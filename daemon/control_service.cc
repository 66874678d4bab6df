#include "control_service.h"

#include <spdlog/spdlog.h>
#include <unistd.h>

#include <cstdint>

namespace trainstream::daemon {

grpc::Status ControlService::Authorize(grpc::ServerContext* ctx, PeerCredentials* creds) {
  state_->Touch();
  if (!peers_->Lookup(ctx->peer(), creds)) {
    return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                        "trainstreamd cannot identify the caller (peer '" + ctx->peer() + "')");
  }
  if (creds->allowed) return grpc::Status::OK;
  std::string who = "root, uid " + std::to_string(geteuid());
  if (!config_.allow_group.empty()) who += " and members of group '" + config_.allow_group + "'";
  if (!config_.admin_group.empty()) who += " and members of group '" + config_.admin_group + "'";
  return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                      "uid " + std::to_string(creds->uid) + " (pid " + std::to_string(creds->pid) +
                          ") may not use trainstreamd at " + state_->socket_path +
                          "; allowed: " + who + " (daemon option allow_group / --allow-group)");
}

grpc::Status ControlService::Ping(grpc::ServerContext* ctx, const v1::PingRequest*,
                                  v1::PingResponse* resp) {
  PeerCredentials creds;
  if (auto s = Authorize(ctx, &creds); !s.ok()) return s;
  resp->set_version(kDaemonVersion);
  resp->set_protocol_version(kProtocolVersion);
  resp->set_pid(getpid());
  resp->set_uptime_s(state_->uptime_s());
  return grpc::Status::OK;
}

grpc::Status ControlService::Attach(grpc::ServerContext* ctx, SessionStream* stream) {
  PeerCredentials creds;
  if (auto s = Authorize(ctx, &creds); !s.ok()) return s;
  v1::SessionMessage first;
  if (!stream->Read(&first)) {
    return grpc::Status(grpc::StatusCode::CANCELLED,
                        "the session stream closed before AttachRequest");
  }
  if (first.body_case() != v1::SessionMessage::kAttach) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "attach: the first message on the session stream must be an AttachRequest");
  }
  if (state_->shutting_down.load()) {
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "trainstreamd is shutting down");
  }
  if (state_->draining.load()) {
    return grpc::Status(
        grpc::StatusCode::UNAVAILABLE,
        "trainstreamd is draining: existing sessions continue, new ones are refused");
  }
  std::shared_ptr<Session> session;
  v1::SessionEvent event;
  grpc::Status st =
      registry_->Create(creds, first.attach(), ctx, stream, &session, event.mutable_attached());
  if (!st.ok()) {
    spdlog::warn("attach refused for pid {} uid {}: {}", creds.pid, creds.uid, st.error_message());
    return st;
  }
  const uint64_t id = session->id;
  if (!session->Send(event)) {
    registry_->End(id, "could not send Attached", false);
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "session stream closed during attach");
  }
  v1::SessionMessage extra;
  while (stream->Read(&extra)) {
    // Only the first message is defined; later ones are ignored (forward compatible).
    spdlog::debug("session {}: ignoring a message after AttachRequest", id);
  }
  const bool shutting_down = state_->shutting_down.load();
  registry_->End(id, shutting_down ? "daemon shutting down" : "session stream closed", false);
  state_->Touch();
  state_->WakeMainLoop();  // a drain may be waiting for the last session
  if (shutting_down) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "trainstreamd shut down");
  return grpc::Status::OK;
}

grpc::Status ControlService::RegisterParameters(grpc::ServerContext* ctx,
                                                const v1::RegisterParametersRequest* req,
                                                v1::RegisterParametersResponse* resp) {
  PeerCredentials creds;
  if (auto s = Authorize(ctx, &creds); !s.ok()) return s;
  std::shared_ptr<Session> session;
  if (auto s = registry_->Find(req->session_id(), req->session_token(), creds, &session); !s.ok())
    return s;
  grpc::Status st = registry_->RegisterParameters(*session, *req, resp);
  if (!st.ok())
    spdlog::info("session {}: RegisterParameters refused: {}", session->id, st.error_message());
  return st;
}

grpc::Status ControlService::AllocateRegion(grpc::ServerContext* ctx,
                                            const v1::AllocateRegionRequest* req,
                                            v1::AllocateRegionResponse* resp) {
  PeerCredentials creds;
  if (auto s = Authorize(ctx, &creds); !s.ok()) return s;
  std::shared_ptr<Session> session;
  if (auto s = registry_->Find(req->session_id(), req->session_token(), creds, &session); !s.ok())
    return s;
  grpc::Status st = registry_->AllocateRegion(*session, *req, resp->mutable_region());
  if (!st.ok())
    spdlog::info("session {}: AllocateRegion refused: {}", session->id, st.error_message());
  return st;
}

grpc::Status ControlService::FreeRegion(grpc::ServerContext* ctx, const v1::FreeRegionRequest* req,
                                        v1::FreeRegionResponse* resp) {
  PeerCredentials creds;
  if (auto s = Authorize(ctx, &creds); !s.ok()) return s;
  std::shared_ptr<Session> session;
  if (auto s = registry_->Find(req->session_id(), req->session_token(), creds, &session); !s.ok())
    return s;
  uint64_t freed = 0;
  grpc::Status st = registry_->FreeRegion(*session, *req, &freed);
  resp->set_bytes_freed(freed);
  return st;
}

grpc::Status ControlService::Status(grpc::ServerContext* ctx, const v1::StatusRequest*,
                                    v1::StatusResponse* resp) {
  PeerCredentials creds;
  if (auto s = Authorize(ctx, &creds); !s.ok()) return s;
  resp->set_version(kDaemonVersion);
  resp->set_pid(getpid());
  resp->set_uptime_s(state_->uptime_s());
  resp->set_socket_path(state_->socket_path);
  resp->set_shm_dir(config_.shm_dir);
  resp->set_budget_limit(budget_->limit());
  resp->set_budget_used(budget_->used());
  resp->set_pinned_bytes(registry_->pinned_bytes());
  resp->set_draining(state_->draining.load());
  resp->set_worker_threads(state_->worker_threads);
  registry_->FillStatus(resp);
  FillBaseStatus(resp);
  return grpc::Status::OK;
}

grpc::Status ControlService::Shutdown(grpc::ServerContext* ctx, const v1::ShutdownRequest* req,
                                      v1::ShutdownResponse* resp) {
  PeerCredentials creds;
  if (auto s = Authorize(ctx, &creds); !s.ok()) return s;
  if (!creds.admin) {
    std::string who = "root, uid " + std::to_string(geteuid());
    if (!config_.admin_group.empty()) who += " and members of group '" + config_.admin_group + "'";
    return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                        "uid " + std::to_string(creds.uid) +
                            " may not shut trainstreamd down; admins: " + who +
                            " (daemon option admin_group)");
  }
  resp->set_sessions(static_cast<uint32_t>(registry_->size()));
  spdlog::info("shutdown requested by uid {} pid {} (drain={})", creds.uid, creds.pid,
               req->drain());
  if (req->drain()) {
    if (!state_->draining.exchange(true)) {
      v1::DaemonNotice notice;
      notice.set_kind(v1::DaemonNotice::KIND_DRAIN);
      notice.set_message("trainstreamd is draining: finish your work; new sessions are refused");
      registry_->NotifyAll(notice);
    }
  }
  state_->shutdown_requested.store(true);
  state_->WakeMainLoop();
  return grpc::Status::OK;
}

}  // namespace trainstream::daemon
