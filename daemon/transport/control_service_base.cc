// ControlService's frozen-base RPCs: LoadBase, ReleaseBase, ListBases, DropBase,
// ShareBaseVram
// (docs/base-cache.md). The work is BaseCache's; these authorise and translate.
#include <spdlog/spdlog.h>

#include <chrono>

#include "logging/log_safe.h"
#include "trainstream/platform/machine.h"
#include "transport/control_service.h"

namespace trainstream::daemon {
namespace {

void ToProto(const base::BaseInfo& b, v1::BaseInfo* out) {
  out->set_key(b.key);
  out->set_path(b.path);
  out->set_format(b.format);
  out->set_block_size(static_cast<uint32_t>(b.block_size));
  out->set_owner_uid(b.owner_uid);
  out->set_segment_name(b.segment_name);
  out->set_segment_bytes(b.segment_bytes);
  out->set_source_bytes(b.source_bytes);
  out->set_tensors(b.tensors);
  out->set_quantized_tensors(b.quantized_tensors);
  out->set_refcount(b.refcount);
  for (uint64_t s : b.sessions) out->add_sessions(s);
  out->set_load_seconds(b.load_seconds);
  out->set_scratch_peak_bytes(b.scratch_peak_bytes);
  out->set_cached(b.cached);
  out->set_vram_copies(b.vram_copies);
  out->set_vram_bytes(b.vram_bytes);
  out->set_load_threads(b.load_threads);
  out->set_allocate_seconds(b.allocate_seconds);
}

}  // namespace

void ControlService::FillBaseStatus(v1::StatusResponse* resp) {
  PeerCredentials all;
  all.admin = true;  // status lists every base, as it lists every session
  for (const auto& b : bases_->List(all)) {
    auto* bs = resp->add_bases();
    bs->set_key(b.key);
    bs->set_bytes(b.segment_bytes);
    bs->set_refcount(b.refcount);
    bs->set_format(b.format);
    bs->set_path(b.path);
    bs->set_owner_uid(b.owner_uid);
    auto* seg = resp->add_segments();
    seg->set_name(b.segment_name);
    seg->set_kind(v1::SEGMENT_KIND_BASE);
    seg->set_bytes(b.segment_bytes);
    seg->set_session_id(0);
    seg->set_label("base " + b.key);
  }
}

grpc::Status ControlService::LoadBase(grpc::ServerContext* ctx, const v1::LoadBaseRequest* req,
                                      grpc::ServerWriter<v1::LoadBaseEvent>* writer) {
  PeerCredentials creds;
  if (auto s = Authorize(ctx, &creds); !s.ok()) return s;
  std::shared_ptr<Session> session;
  if (req->session_id() != 0) {
    if (auto s = registry_->Find(req->session_id(), req->session_token(), creds, &session); !s.ok())
      return ToGrpc(s);
  }
  base::BaseLoadOptions options;
  options.path = req->path();
  options.format = req->format();
  options.block_size = req->block_size();
  options.threads = req->threads();
  // Progress at most every 100 ms (and the last one). The load stops when the
  // client goes away (the call is cancelled), the daemon shuts down, or the
  // session it loads for ends: why, in `stopped`.
  auto last_sent = std::chrono::steady_clock::now() - std::chrono::seconds(1);
  auto last_polled = last_sent;
  const char* stopped = nullptr;
  auto progress = [&](const base::LoadProgress& p) {
    const auto now = std::chrono::steady_clock::now();
    if (state_->shutting_down.load()) stopped = "the daemon is shutting down";
    // IsCancelled plucks the call's completion queue (~20 us, measured): once
    // per tensor made a header of 200k empty tensors cost 4 s. Every 10 ms.
    if (stopped == nullptr && now - last_polled >= std::chrono::milliseconds(10)) {
      last_polled = now;
      if (ctx->IsCancelled()) {
        stopped = "the client went away";
      } else if (session) {
        std::lock_guard<std::mutex> lock(session->mu);
        if (session->closed) stopped = "its session ended";
      }
    }
    if (stopped != nullptr) return false;
    state_->Touch();  // a long load is activity (embedded mode's idle exit)
    if (p.tensors_total == 0 ||
        (now - last_sent < std::chrono::milliseconds(100) && p.tensors_done != p.tensors_total)) {
      return true;
    }
    last_sent = now;
    v1::LoadBaseEvent event;
    auto* pe = event.mutable_progress();
    pe->set_bytes_read(p.bytes_read);
    pe->set_bytes_total(p.bytes_total);
    pe->set_tensors_done(p.tensors_done);
    pe->set_tensors_total(p.tensors_total);
    pe->set_threads(p.threads);
    writer->Write(event);
    return true;
  };
  base::BaseInfo info;
  trainstream::Status st = bases_->Load(creds, options, session ? session->id : 0, progress, &info);
  // A header near the tensor cap parses into a few hundred MB of short-lived
  // JSON nodes; hand those pages back now rather than keep them as the daemon's
  // RSS for good (a client could grow it so, one crafted header at a time).
  platform::ReturnFreedMemory();
  if (st.code() == StatusCode::kCancelled && stopped != nullptr) {
    st = trainstream::Status(StatusCode::kCancelled, std::string(base::kLoadCancelled) + ": " +
                                                         stopped + " (nothing was kept)");
  }
  if (!st.ok()) {
    spdlog::info("LoadBase of '{}' by uid {} pid {} refused: {}", LogSafe(options.path), creds.uid,
                 creds.pid, LogSafe(st.message(), 1024));
    return ToGrpc(st);
  }
  if (session) {
    // A session that ended while this load ran must not keep a reference: End()
    // sets `closed` before its end hook releases the session's bases.
    std::lock_guard<std::mutex> lock(session->mu);
    if (session->closed) {
      bases_->ReleaseSession(session->id);
      return grpc::Status(grpc::StatusCode::NOT_FOUND, "session_id: the session has ended");
    }
  }
  v1::LoadBaseEvent event;
  auto* done = event.mutable_done();
  ToProto(info, done->mutable_base());
  auto* region = done->mutable_region();
  region->set_region_id(0);
  region->set_segment_name(info.segment_name);
  region->set_offset(0);
  region->set_length(info.segment_bytes);
  region->set_segment_size(info.segment_bytes);
  region->set_kind(v1::SEGMENT_KIND_BASE);
  region->set_read_only(true);
  done->set_shm_dir(config_.shm_dir);
  writer->Write(event);
  return grpc::Status::OK;
}

grpc::Status ControlService::ReleaseBase(grpc::ServerContext* ctx,
                                         const v1::ReleaseBaseRequest* req,
                                         v1::ReleaseBaseResponse*) {
  return WithSession(ctx, *req, [&](const PeerCredentials&, Session& session) {
    return bases_->Release(session.id, req->key());
  });
}

grpc::Status ControlService::ListBases(grpc::ServerContext* ctx, const v1::ListBasesRequest*,
                                       v1::ListBasesResponse* resp) {
  PeerCredentials creds;
  if (auto s = Authorize(ctx, &creds); !s.ok()) return s;
  for (const auto& b : bases_->List(creds)) ToProto(b, resp->add_bases());
  return grpc::Status::OK;
}

grpc::Status ControlService::DropBase(grpc::ServerContext* ctx, const v1::DropBaseRequest* req,
                                      v1::DropBaseResponse* resp) {
  PeerCredentials creds;
  if (auto s = Authorize(ctx, &creds); !s.ok()) return s;
  uint64_t freed = 0;
  trainstream::Status st = bases_->Drop(creds, req->key(), &freed);
  resp->set_bytes_freed(freed);
  return ToGrpc(st);
}

grpc::Status ControlService::ShareBaseVram(grpc::ServerContext* ctx,
                                           const v1::ShareBaseVramRequest* req,
                                           v1::ShareBaseVramResponse* resp) {
  return WithSession(ctx, *req, [&](const PeerCredentials&, Session& session) {
    if (req->pci_bus_id().size() > 64) {
      return trainstream::Status(StatusCode::kInvalidArgument,
                                 "pci_bus_id: longer than 64 characters (e.g. '0000:19:00.0')");
    }
    base::VramDevice device;
    device.pci_bus_id = req->pci_bus_id();
    device.index = req->device();
    base::VramShareInfo info;
    trainstream::Status st = bases_->ShareVram(session.id, req->key(), device, &info);
    if (!st.ok()) return st;
    resp->set_ipc_handle(info.ipc_handle);
    resp->set_bytes(info.bytes);
    resp->set_device(info.device);
    resp->set_pci_bus_id(info.pci_bus_id);
    resp->set_cached(info.cached);
    resp->set_copy_seconds(info.copy_seconds);
    resp->set_holders(info.holders);
    return trainstream::Status::Ok();
  });
}

}  // namespace trainstream::daemon
