// The frozen-base calls of Client and Session (docs/base-cache.md).
#include <chrono>
#include <filesystem>

#include "client_impl.h"
#include "trainstream/client.h"
#include "trainstream/grpc_status.h"

namespace trainstream {
namespace {

using internal::FromGrpc;

// A load reads (and quantizes) a whole checkpoint: allow hours, not seconds.
constexpr int kLoadTimeoutS = 6 * 3600;
constexpr int kUnaryTimeoutS = 30;
constexpr int kShareTimeoutS = 600;

void ToInfo(const v1::BaseInfo& b, BaseInfo* out) {
  out->key = b.key();
  out->path = b.path();
  out->format = b.format();
  out->block_size = b.block_size();
  out->owner_uid = b.owner_uid();
  out->segment_name = b.segment_name();
  out->segment_bytes = b.segment_bytes();
  out->source_bytes = b.source_bytes();
  out->tensors = b.tensors();
  out->quantized_tensors = b.quantized_tensors();
  out->refcount = b.refcount();
  out->sessions.assign(b.sessions().begin(), b.sessions().end());
  out->load_seconds = b.load_seconds();
  out->scratch_peak_bytes = b.scratch_peak_bytes();
  out->cached = b.cached();
  out->vram_copies = b.vram_copies();
  out->vram_bytes = b.vram_bytes();
  out->load_threads = b.load_threads();
  out->allocate_seconds = b.allocate_seconds();
}

Status MakeRequest(const BaseLoadOptions& options, v1::LoadBaseRequest* req) {
  if (options.path.empty()) return Status(StatusCode::kInvalidArgument, "path: empty");
  std::error_code ec;
  const auto abs = std::filesystem::absolute(options.path, ec);
  if (ec) {
    return Status(StatusCode::kInvalidArgument,
                  "path: cannot make '" + options.path + "' absolute: " + ec.message());
  }
  req->set_path(abs.lexically_normal().string());
  req->set_format(options.format);
  req->set_block_size(options.block_size);
  req->set_threads(options.threads);
  return Status::Ok();
}

// Runs the LoadBase stream to its end; `done` receives the final event.
Status RunLoad(v1::Control::Stub* stub, const platform::ControlTarget& target,
               const std::string& socket_path, const v1::LoadBaseRequest& req,
               const BaseProgressFn& progress, v1::LoadBaseDone* done) {
  grpc::ClientContext ctx;
  PrepareCall(target, &ctx, kLoadTimeoutS);
  auto reader = stub->LoadBase(&ctx, req);
  v1::LoadBaseEvent event;
  bool got_done = false;
  while (reader->Read(&event)) {
    if (event.has_progress() && progress) {
      const auto& p = event.progress();
      progress(BaseProgress{p.bytes_read(), p.bytes_total(), p.tensors_done(), p.tensors_total(),
                            p.threads()});
    } else if (event.has_done()) {
      *done = event.done();
      got_done = true;
    }
  }
  Status s = FromGrpc(reader->Finish(), socket_path);
  if (s.ok() && !got_done) {
    return Status(StatusCode::kInternal, "trainstreamd ended LoadBase without a result");
  }
  return s;
}

}  // namespace

Status Client::LoadBase(const BaseLoadOptions& options, const BaseProgressFn& progress,
                        BaseInfo* out) {
  v1::LoadBaseRequest req;
  Status s = MakeRequest(options, &req);
  if (!s.ok()) return s;
  v1::LoadBaseDone done;
  s = RunLoad(impl_->stub.get(), impl_->target, impl_->socket_path, req, progress, &done);
  if (s.ok()) ToInfo(done.base(), out);
  return s;
}

Status Client::ListBases(std::vector<BaseInfo>* out) {
  grpc::ClientContext ctx;
  PrepareCall(impl_->target, &ctx, kUnaryTimeoutS);
  v1::ListBasesResponse resp;
  Status s =
      FromGrpc(impl_->stub->ListBases(&ctx, v1::ListBasesRequest(), &resp), impl_->socket_path);
  if (!s.ok()) return s;
  out->clear();
  for (const auto& b : resp.bases()) {
    out->emplace_back();
    ToInfo(b, &out->back());
  }
  return Status::Ok();
}

Status Client::DropBase(const std::string& key, uint64_t* bytes_freed) {
  grpc::ClientContext ctx;
  PrepareCall(impl_->target, &ctx, kUnaryTimeoutS);
  v1::DropBaseRequest req;
  req.set_key(key);
  v1::DropBaseResponse resp;
  Status s = FromGrpc(impl_->stub->DropBase(&ctx, req, &resp), impl_->socket_path);
  if (s.ok() && bytes_freed != nullptr) *bytes_freed = resp.bytes_freed();
  return s;
}

Status Session::LoadBase(const BaseLoadOptions& options, const BaseProgressFn& progress,
                         BaseInfo* info, std::unique_ptr<MappedRegion>* mapped) {
  v1::LoadBaseRequest req;
  Status s = MakeRequest(options, &req);
  if (!s.ok()) return s;
  req.set_session_id(impl_->id);
  req.set_session_token(impl_->token);
  v1::LoadBaseDone done;
  s = RunLoad(impl_->stub.get(), impl_->target, impl_->socket_path, req, progress, &done);
  if (!s.ok()) return s;
  ToInfo(done.base(), info);
  const v1::Region& r = done.region();
  RegionInfo region;
  region.region_id = r.region_id();
  region.segment_name = r.segment_name();
  region.offset = r.offset();
  region.length = r.length();
  region.segment_size = r.segment_size();
  region.kind = SegmentKind::kBase;
  region.read_only = true;
  s = MappedRegion::Map(done.shm_dir(), region, mapped);
  if (!s.ok()) ReleaseBase(info->key);
  return s;
}

Status Session::ReleaseBase(const std::string& key) {
  grpc::ClientContext ctx;
  PrepareCall(impl_->target, &ctx, kUnaryTimeoutS);
  v1::ReleaseBaseRequest req;
  req.set_session_id(impl_->id);
  req.set_session_token(impl_->token);
  req.set_key(key);
  v1::ReleaseBaseResponse resp;
  return FromGrpc(impl_->stub->ReleaseBase(&ctx, req, &resp), impl_->socket_path);
}

Status Session::ShareBaseVram(const std::string& key, const std::string& pci_bus_id, int32_t device,
                              VramShare* out) {
  grpc::ClientContext ctx;
  // The first call per GPU copies the whole base (seconds for tens of GB).
  PrepareCall(impl_->target, &ctx, kShareTimeoutS);
  v1::ShareBaseVramRequest req;
  req.set_session_id(impl_->id);
  req.set_session_token(impl_->token);
  req.set_key(key);
  req.set_pci_bus_id(pci_bus_id);
  req.set_device(device);
  v1::ShareBaseVramResponse resp;
  Status s = FromGrpc(impl_->stub->ShareBaseVram(&ctx, req, &resp), impl_->socket_path);
  if (!s.ok()) return s;
  out->ipc_handle = resp.ipc_handle();
  out->bytes = resp.bytes();
  out->device = resp.device();
  out->pci_bus_id = resp.pci_bus_id();
  out->cached = resp.cached();
  out->copy_seconds = resp.copy_seconds();
  out->holders = resp.holders();
  return Status::Ok();
}

}  // namespace trainstream
