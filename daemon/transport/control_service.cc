#include "transport/control_service.h"

#include <spdlog/spdlog.h>

#include <cstdint>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "logging/log_safe.h"
#include "trainstream/platform/control_channel.h"
#include "trainstream/platform/process_watcher.h"
#include "trainstream/platform/this_process.h"
#include "trainstream/platform/user.h"

namespace trainstream::daemon {
namespace {

// Note [Client strings in the log] (logging/log_safe.h): job names, group keys,
// region labels and parameter names are shown by `trainstreamctl status` or logged
// (inside error messages too), so they must be plain text.
Status CheckPrintable(const std::string& text, const char* field, const char* what) {
  if (PrintableUtf8(text)) return Status::Ok();
  return Status(StatusCode::kInvalidArgument,
                std::string(field) + ": '" + LogSafe(text) + "' holds a control character " +
                    "or invalid UTF-8; " + what +
                    " must be printable UTF-8 text (no newline, tab or escape)");
}

// Keeps the elements of a repeated field for which `keep` is true, in order.
template <typename Repeated, typename Keep>
void KeepIf(Repeated* items, Keep keep) {
  int kept = 0;
  for (int i = 0; i < items->size(); ++i) {
    if (keep(items->Get(i))) items->SwapElements(kept++, i);
  }
  items->DeleteSubrange(kept, items->size() - kept);
}

// Note [Status shows a user only their own]: another user's pids, job names and
// segment names are not a non-admin's to see (docs/security.md). The
// registries fill the whole picture; this keeps, for a non-admin, the caller's
// sessions, their segments, the caller's groups and bases and their segments,
// and the machine-wide totals (budget, pinned bytes). A group's segments carry
// session_id 0 and name their group only in the label ("group 'KEY' ..."), and
// two users may each have a group of one key, so a group segment is kept only
// when every group its label can name is the caller's.
void KeepOnlyCallers(const PeerCredentials& caller, const std::set<std::string>& base_segments,
                     v1::StatusResponse* resp) {
  std::set<uint64_t> sessions;
  for (const auto& s : resp->sessions())
    if (s.uid() == caller.uid) sessions.insert(s.session_id());
  std::vector<std::pair<std::string, bool>> groups;  // (label prefix, the caller's)
  for (const auto& g : resp->groups())
    groups.emplace_back("group '" + g.key() + "' ", g.uid() == caller.uid);
  auto is_callers_group_segment = [&](const std::string& label) {
    bool named = false;
    for (const auto& [prefix, mine] : groups) {
      if (label.compare(0, prefix.size(), prefix) != 0) continue;
      if (!mine) return false;
      named = true;
    }
    return named;
  };
  KeepIf(resp->mutable_sessions(),
         [&](const v1::SessionStatus& s) { return s.uid() == caller.uid; });
  KeepIf(resp->mutable_groups(), [&](const v1::GroupStatus& g) { return g.uid() == caller.uid; });
  KeepIf(resp->mutable_bases(),
         [&](const v1::BaseStatus& b) { return b.owner_uid() == caller.uid; });
  KeepIf(resp->mutable_segments(), [&](const v1::SegmentStatus& seg) {
    if (seg.session_id() != 0) return sessions.count(seg.session_id()) != 0;
    if (seg.kind() == v1::SEGMENT_KIND_BASE) return base_segments.count(seg.name()) != 0;
    return is_callers_group_segment(seg.label());
  });
}

}  // namespace

grpc::Status ControlService::Authorize(grpc::ServerContext* ctx, PeerCredentials* creds) {
  state_->Touch();
  if (!platform::CallCarriesEndpointSecret(*ctx, state_->endpoint_secret)) {
    return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                        "the call does not carry the secret of trainstreamd's endpoint file " +
                            state_->socket_path + " (a client proves it may read that file)");
  }
  if (!peers_->Lookup(ctx->peer(), creds)) {
    return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                        "trainstreamd cannot identify the caller (peer '" + ctx->peer() + "')");
  }
  if (creds->allowed) return grpc::Status::OK;
  std::string who = "root, uid " + std::to_string(platform::CurrentUserId());
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
  resp->set_pid(platform::CurrentProcessId());
  resp->set_uptime_s(state_->uptime_s());
  return grpc::Status::OK;
}

// The Attach call's stream as the session registry writes to and cancels it.
class GrpcSessionStream final : public SessionStream {
 public:
  GrpcSessionStream(grpc::ServerContext* ctx,
                    grpc::ServerReaderWriter<v1::SessionEvent, v1::SessionMessage>* stream)
      : ctx_(ctx), stream_(stream) {}
  bool Write(const v1::SessionEvent& event) override { return stream_->Write(event); }
  void Cancel() override { ctx_->TryCancel(); }

 private:
  grpc::ServerContext* const ctx_;
  grpc::ServerReaderWriter<v1::SessionEvent, v1::SessionMessage>* const stream_;
};

grpc::Status ControlService::Attach(
    grpc::ServerContext* ctx,
    grpc::ServerReaderWriter<v1::SessionEvent, v1::SessionMessage>* stream) {
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
  if (auto s = CheckPrintable(first.attach().job(), "attach.job", "job names"); !s.ok())
    return ToGrpc(s);
  // Linux: SO_PEERCRED's pid; Windows: the stated one, of this user's process.
  creds.pid = static_cast<pid_t>(platform::SessionProcess(creds.pid, first.attach().pid()));
  if (auto s = CheckPrintable(first.attach().group().key(), "attach.group.key", "group keys");
      !s.ok())
    return ToGrpc(s);
  if (state_->shutting_down.load()) {
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "trainstreamd is shutting down");
  }
  if (state_->draining.load()) {
    return grpc::Status(
        grpc::StatusCode::UNAVAILABLE,
        "trainstreamd is draining: existing sessions continue, new ones are refused");
  }
  // Lives until this handler returns; the session lets go of it before then.
  GrpcSessionStream session_stream(ctx, stream);
  std::shared_ptr<Session> session;
  v1::SessionEvent event;
  trainstream::Status st =
      registry_->Create(creds, first.attach(), &session_stream, &session, event.mutable_attached());
  if (!st.ok()) {
    spdlog::warn("attach refused for pid {} uid {}: {}", creds.pid, creds.uid,
                 LogSafe(st.message(), 1024));
    return ToGrpc(st);
  }
  const uint64_t id = session->id;
  // Another thread's End (the reaper, the pid watcher) may still be writing its
  // notice on this stream or cancelling it; End returns at once here when that
  // one took the session first. The stream dies with this handler, so take it
  // back first: after this, no other thread touches it.
  auto take_back_stream = [&session] {
    std::lock_guard<std::mutex> lock(session->stream_mu);
    session->stream = nullptr;
  };
  if (!session->Send(event)) {
    registry_->End(id, "could not send Attached", false);
    take_back_stream();
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "session stream closed during attach");
  }
  v1::SessionMessage extra;
  while (stream->Read(&extra)) {
    // Only the first message is defined; later ones are ignored (forward compatible).
    spdlog::debug("session {}: ignoring a message after AttachRequest", id);
  }
  if (state_->keeping_state.load()) {
    // Note [A restart keeps the optimizer state] (daemon.cc): the daemon exits next
    // and leaves this session's state for the next one; its client resumes there.
    take_back_stream();
    return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                        "trainstreamd stopped; this session's optimizer state is kept for the "
                        "next daemon on this socket");
  }
  const bool shutting_down = state_->shutting_down.load();
  registry_->End(id, shutting_down ? "daemon shutting down" : "session stream closed", false);
  take_back_stream();
  state_->Touch();
  state_->WakeMainLoop();  // a drain may be waiting for the last session
  if (shutting_down) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "trainstreamd shut down");
  return grpc::Status::OK;
}

grpc::Status ControlService::RegisterParameters(grpc::ServerContext* ctx,
                                                const v1::RegisterParametersRequest* req,
                                                v1::RegisterParametersResponse* resp) {
  return WithSession(ctx, *req, [&](const PeerCredentials&, Session& session) {
    for (int i = 0; i < req->params_size(); ++i) {
      const std::string field = "params[" + std::to_string(i) + "].name";
      if (auto s = CheckPrintable(req->params(i).name(), field.c_str(), "parameter names"); !s.ok())
        return s;
    }
    if (auto s = CheckPrintable(req->weights_checksum(), "weights_checksum", "checksums"); !s.ok())
      return s;
    trainstream::Status st = registry_->RegisterParameters(session, *req, resp);
    if (!st.ok())
      spdlog::info("session {}: RegisterParameters refused: {}", session.id,
                   LogSafe(st.message(), 1024));
    return st;
  });
}

grpc::Status ControlService::AllocateRegion(grpc::ServerContext* ctx,
                                            const v1::AllocateRegionRequest* req,
                                            v1::AllocateRegionResponse* resp) {
  return WithSession(ctx, *req, [&](const PeerCredentials&, Session& session) {
    if (auto s = CheckPrintable(req->label(), "label", "region labels"); !s.ok()) return s;
    trainstream::Status st = registry_->AllocateRegion(session, *req, resp->mutable_region());
    if (!st.ok())
      spdlog::info("session {}: AllocateRegion refused: {}", session.id,
                   LogSafe(st.message(), 1024));
    return st;
  });
}

grpc::Status ControlService::FreeRegion(grpc::ServerContext* ctx, const v1::FreeRegionRequest* req,
                                        v1::FreeRegionResponse* resp) {
  return WithSession(ctx, *req, [&](const PeerCredentials&, Session& session) {
    uint64_t freed = 0;
    trainstream::Status st = registry_->FreeRegion(session, *req, &freed);
    resp->set_bytes_freed(freed);
    return st;
  });
}

grpc::Status ControlService::Status(grpc::ServerContext* ctx, const v1::StatusRequest*,
                                    v1::StatusResponse* resp) {
  PeerCredentials creds;
  if (auto s = Authorize(ctx, &creds); !s.ok()) return s;
  resp->set_version(kDaemonVersion);
  resp->set_pid(platform::CurrentProcessId());
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
  if (!creds.admin) {
    std::set<std::string> base_segments;
    if (bases_ != nullptr)
      for (const auto& b : bases_->List(creds)) base_segments.insert(b.segment_name);
    KeepOnlyCallers(creds, base_segments, resp);
  }
  return grpc::Status::OK;
}

grpc::Status ControlService::Shutdown(grpc::ServerContext* ctx, const v1::ShutdownRequest* req,
                                      v1::ShutdownResponse* resp) {
  PeerCredentials creds;
  if (auto s = Authorize(ctx, &creds); !s.ok()) return s;
  if (!creds.admin) {
    std::string who = "root, uid " + std::to_string(platform::CurrentUserId());
    if (!config_.admin_group.empty()) who += " and members of group '" + config_.admin_group + "'";
    return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                        "uid " + std::to_string(creds.uid) +
                            " may not shut trainstreamd down; admins: " + who +
                            " (daemon option admin_group)");
  }
  const size_t sessions = registry_->size();
  resp->set_sessions(static_cast<uint32_t>(sessions));
  // What the main loop will decide, unless sessions come and go meanwhile (Note [A
  // restart keeps the optimizer state], daemon.cc).
  const bool discard = req->drain() || req->discard_state();
  resp->set_state_kept(!discard && config_.recovery_grace_s > 0 &&
                       (sessions > 0 || registry_->adopted_waiting() > 0));
  resp->set_recovery_grace_s(config_.recovery_grace_s);
  spdlog::info("shutdown requested by uid {} pid {} (drain={}, discard_state={})", creds.uid,
               creds.pid, req->drain(), req->discard_state());
  if (!req->drain() && req->discard_state()) state_->discard_state.store(true);
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
