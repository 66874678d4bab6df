#include "trainstream/client.h"

#include <chrono>
#include <cstdint>

#include "client_impl.h"
#include "status_json.h"
#include "trainstream/grpc_status.h"
#include "trainstream/platform/this_process.h"

namespace trainstream {
namespace {

using internal::FromGrpc;

// Control-plane calls are quick, except segment creation, which faults in and
// possibly locks gigabytes.
constexpr int kUnaryTimeoutS = 120;

// Note [Segment kind numbers are the wire's]: a Region's kind is a cast.
static_assert(static_cast<uint32_t>(SegmentKind::kBase) == v1::SEGMENT_KIND_BASE);
static_assert(static_cast<uint32_t>(SegmentKind::kSession) == v1::SEGMENT_KIND_SESSION);
static_assert(static_cast<uint32_t>(SegmentKind::kState) == v1::SEGMENT_KIND_STATE);

RegionInfo ToInfo(const v1::Region& r) {
  RegionInfo info;
  info.region_id = r.region_id();
  info.segment_name = r.segment_name();
  info.offset = r.offset();
  info.length = r.length();
  info.segment_size = r.segment_size();
  info.kind = static_cast<SegmentKind>(r.kind());
  info.read_only = r.read_only();
  return info;
}

}  // namespace

void PrepareCall(const platform::ControlTarget& target, grpc::ClientContext* ctx, int seconds) {
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(seconds));
  platform::AddEndpointSecret(target, ctx);
}

std::string DefaultSocketPath() { return platform::DefaultControlEndpoint(); }
std::string EmbeddedSocketPath() { return platform::EmbeddedControlEndpoint(); }

// ---------------------------------------------------------------------------
// Client

Client::Client(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Client::~Client() = default;

Status Client::Connect(const std::string& socket_path, int timeout_ms,
                       std::unique_ptr<Client>* out) {
  if (socket_path.empty()) return Status(StatusCode::kInvalidArgument, "socket_path: empty");
  // A socket this uid may not open is reported now, not after the timeout, and
  // not as "no daemon answers" (which makes callers start one of their own).
  if (std::string denied = platform::DescribeEndpointAccessDenied(socket_path); !denied.empty())
    return Status(StatusCode::kPermissionDenied, denied);
  auto impl = std::make_unique<Impl>();
  impl->socket_path = socket_path;
  // Where there is an endpoint file (Windows), no file is no daemon: said now,
  // as UNAVAILABLE, so a caller may start one.
  if (std::string why; platform::ResolveControlTarget(socket_path, &impl->target, &why) != 0)
    return Status(StatusCode::kUnavailable,
                  "cannot reach trainstreamd at " + socket_path + ": " + why);
  grpc::ChannelArguments args;
  // One connection per client; sessions multiplex over it.
  args.SetInt(GRPC_ARG_ENABLE_RETRIES, 0);
  impl->channel =
      grpc::CreateCustomChannel(impl->target.grpc_target, grpc::InsecureChannelCredentials(), args);
  const auto deadline = std::chrono::system_clock::now() + std::chrono::milliseconds(timeout_ms);
  if (!impl->channel->WaitForConnected(deadline)) {
    bool closed_at_once = false;
    const std::string hint = platform::DescribeEndpointUnreachable(socket_path, &closed_at_once);
    // A daemon that refuses this uid's connection runs: RESOURCE_EXHAUSTED, so
    // that nobody starts another one (UNAVAILABLE says none answers).
    return Status(closed_at_once ? StatusCode::kResourceExhausted : StatusCode::kUnavailable,
                  "cannot reach trainstreamd at " + socket_path + " within " +
                      std::to_string(timeout_ms) + " ms: " + hint);
  }
  impl->stub = v1::Control::NewStub(impl->channel);
  out->reset(new Client(std::move(impl)));
  return Status::Ok();
}

const std::string& Client::socket_path() const { return impl_->socket_path; }

Status Client::Ping(PingResult* out) {
  grpc::ClientContext ctx;
  PrepareCall(impl_->target, &ctx, 10);
  v1::PingRequest req;
  v1::PingResponse resp;
  Status s = FromGrpc(impl_->stub->Ping(&ctx, req, &resp), impl_->socket_path);
  if (!s.ok()) return s;
  out->version = resp.version();
  out->protocol_version = resp.protocol_version();
  out->pid = resp.pid();
  out->uptime_s = resp.uptime_s();
  return Status::Ok();
}

Status Client::StatusJson(std::string* out) {
  grpc::ClientContext ctx;
  PrepareCall(impl_->target, &ctx, 10);
  v1::StatusRequest req;
  v1::StatusResponse resp;
  Status s = FromGrpc(impl_->stub->Status(&ctx, req, &resp), impl_->socket_path);
  if (!s.ok()) return s;
  *out = internal::StatusToJson(resp, 2);
  return Status::Ok();
}

Status Client::Shutdown(ShutdownMode mode, ShutdownResult* out) {
  grpc::ClientContext ctx;
  PrepareCall(impl_->target, &ctx, 10);
  v1::ShutdownRequest req;
  req.set_drain(mode == ShutdownMode::kDrain);
  req.set_discard_state(mode == ShutdownMode::kDiscardState);
  v1::ShutdownResponse resp;
  Status s = FromGrpc(impl_->stub->Shutdown(&ctx, req, &resp), impl_->socket_path);
  if (s.ok() && out != nullptr) {
    out->sessions = resp.sessions();
    out->state_kept = resp.state_kept();
    out->recovery_grace_s = resp.recovery_grace_s();
  }
  return s;
}

Status Client::Attach(const AttachOptions& options, std::unique_ptr<Session>* out) {
  auto impl = std::make_unique<Session::Impl>();
  impl->socket_path = impl_->socket_path;
  impl->target = impl_->target;
  impl->channel = impl_->channel;
  impl->stub = v1::Control::NewStub(impl->channel);
  // The session lives as long as its stream: no deadline, only the secret.
  platform::AddEndpointSecret(impl->target, &impl->stream_context);
  impl->stream = impl->stub->Attach(&impl->stream_context);
  v1::SessionMessage msg;
  auto* a = msg.mutable_attach();
  a->set_protocol_version(1);
  a->set_pid(platform::CurrentProcessId());
  a->set_job(options.job);
  a->set_rank(options.rank);
  a->set_local_rank(options.local_rank);
  a->set_control_bytes(options.control_bytes);
  if (!options.group.key.empty()) {
    auto* g = a->mutable_group();
    g->set_key(options.group.key);
    g->set_local_rank(options.group.local_rank);
    g->set_local_world_size(options.group.local_world_size);
    g->set_node_rank(options.group.node_rank);
    g->set_nnodes(options.group.nnodes);
    g->set_world_size(options.group.world_size);
    g->set_timeout_s(options.group.timeout_s);
  }
  if (!options.resume_token.empty()) a->mutable_resume()->set_recovery_token(options.resume_token);
  v1::SessionEvent event;
  if (!impl->stream->Write(msg) || !impl->stream->Read(&event)) {
    return FromGrpc(impl->stream->Finish(), impl->socket_path);
  }
  if (event.body_case() != v1::SessionEvent::kAttached) {
    // A notice first: the daemon ended the session during the attach; it says why.
    const std::string why = event.body_case() == v1::SessionEvent::kNotice
                                ? ": " + event.notice().message()
                                : " without an Attached event";
    impl->stream_context.TryCancel();
    impl->stream->Finish();
    return Status(StatusCode::kInternal, "trainstreamd answered Attach" + why);
  }
  const v1::Attached& att = event.attached();
  impl->group_timeout_s = options.group.key.empty() ? 0 : options.group.timeout_s;
  impl->id = att.session_id();
  impl->token = att.session_token();
  impl->recovery_token = att.recovery_token();
  impl->shm_dir = att.shm_dir();
  if (att.has_resumed()) {
    const v1::ResumedState& r = att.resumed();
    auto resumed = std::make_unique<ResumedState>();
    resumed->completed_step = r.completed_step();
    resumed->completed_grad_norm = r.completed_grad_norm();
    resumed->completed_status = r.completed_status();
    resumed->completed_params_updated = r.completed_params_updated();
    resumed->restored_subchunks = r.restored_subchunks();
    resumed->rolled_forward = r.rolled_forward();
    resumed->waited_s = r.waited_s();
    for (const auto& reg : r.registrations()) {
      ResumedRegistration out;
      out.staging = ToInfo(reg.staging());
      for (const auto& sl : reg.slots()) {
        out.slots.push_back(ParameterSlots{sl.param_id(), sl.grad_offset(), sl.param_offset(),
                                           sl.numel(), sl.sum_offset()});
      }
      for (const auto& p : reg.params())
        out.params.push_back(
            ResumedParam{p.param_id(), p.applied_step(), p.skipped(), p.torch_step()});
      out.grad_pool_offset = reg.grad_pool_offset();
      out.grad_pool_bytes = reg.grad_pool_bytes();
      resumed->registrations.push_back(std::move(out));
    }
    impl->resumed = std::move(resumed);
  }
  Status s = MappedRegion::Map(impl->shm_dir, ToInfo(att.control()), &impl->control);
  if (!s.ok()) {
    impl->stream_context.TryCancel();
    impl->stream->Finish();
    return s;
  }
  Session::Impl* raw = impl.get();
  impl->reader = std::thread([raw] { raw->ReadEvents(); });
  out->reset(new Session(std::move(impl)));
  return Status::Ok();
}

// ---------------------------------------------------------------------------
// Session

void Session::Impl::ReadEvents() {
  v1::SessionEvent event;
  while (stream->Read(&event)) {
    if (event.body_case() != v1::SessionEvent::kNotice) continue;
    const auto& n = event.notice();
    std::lock_guard<std::mutex> lock(mu);
    why = n.message();
    if (n.kind() == v1::DaemonNotice::KIND_SHUTDOWN ||
        n.kind() == v1::DaemonNotice::KIND_SESSION_ENDED) {
      alive = false;
      end =
          n.kind() == v1::DaemonNotice::KIND_SHUTDOWN ? SessionEnd::kShutdown : SessionEnd::kEnded;
      // Close our side so the daemon's handler finishes promptly.
      stream_context.TryCancel();
    }
  }
  grpc::Status st = stream->Finish();
  std::lock_guard<std::mutex> lock(mu);
  if (alive) {
    alive = false;
    if (!detached) {
      why = st.ok() ? "the daemon closed the session stream"
                    : "session stream ended: " + st.error_message();
      // A stream that breaks without a notice: the daemon died.
      end = st.ok() ? SessionEnd::kEnded : SessionEnd::kDaemonGone;
    } else {
      why = "detached";
      end = SessionEnd::kDetached;
    }
  }
}

Session::Session(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Session::~Session() { Detach(); }

void Session::Detach() {
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    if (impl_->detached) return;
    impl_->detached = true;
  }
  // Cancelling the stream ends the session on the daemon side at once.
  impl_->stream_context.TryCancel();
  if (impl_->reader.joinable()) impl_->reader.join();
  impl_->control.reset();
}

uint64_t Session::id() const { return impl_->id; }
const std::string& Session::token() const { return impl_->token; }
const std::string& Session::shm_dir() const { return impl_->shm_dir; }
MappedRegion& Session::control() { return *impl_->control; }

SessionEnd Session::end_kind() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->end;
}

std::string Session::recovery_token() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->recovery_token;
}
const ResumedState* Session::resumed() const { return impl_->resumed.get(); }

bool Session::alive(std::string* why) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (why != nullptr) *why = impl_->why;
  return impl_->alive;
}

Status Session::RegisterParameters(const RegisterOptions& options,
                                   const std::vector<ParameterSpec>& params, Registration* out) {
  v1::RegisterParametersRequest req;
  req.set_session_id(impl_->id);
  req.set_session_token(impl_->token);
  for (const auto& g : options.groups) {
    auto* h = req.add_groups();
    h->set_lr(g.lr);
    h->set_beta1(g.beta1);
    h->set_beta2(g.beta2);
    h->set_eps(g.eps);
    h->set_weight_decay(g.weight_decay);
  }
  for (const auto& p : params) {
    auto* spec = req.add_params();
    spec->set_param_id(p.param_id);
    spec->set_name(p.name);
    for (int64_t d : p.shape) spec->add_shape(d);
    spec->set_dtype(static_cast<v1::DType>(p.dtype));
    spec->set_grad_dtype(static_cast<v1::DType>(p.grad_dtype));
    spec->set_group(p.group);
  }
  req.set_moment_dtype(static_cast<v1::DType>(options.moment_dtype));
  req.set_max_grad_norm(options.max_grad_norm);
  req.set_seed(options.seed);
  req.set_threads(options.threads);
  req.set_grad_pool_bytes(options.grad_pool_bytes);
  req.set_weights_checksum(options.weights_checksum);
  grpc::ClientContext ctx;
  // A group member's registration waits for the other local ranks (at most the
  // group's timeout, enforced by the daemon).
  PrepareCall(impl_->target, &ctx, kUnaryTimeoutS + static_cast<int>(impl_->group_timeout_s));
  v1::RegisterParametersResponse resp;
  Status s = FromGrpc(impl_->stub->RegisterParameters(&ctx, req, &resp), impl_->socket_path);
  if (!s.ok()) return s;
  s = MappedRegion::Map(impl_->shm_dir, ToInfo(resp.staging()), &out->staging);
  if (!s.ok()) return s;
  if (!resp.group_recovery_token().empty()) {
    std::lock_guard<std::mutex> lock(impl_->mu);  // recovery_token() readers copy it
    impl_->recovery_token = resp.group_recovery_token();
  }
  out->grad_pool_offset = resp.grad_pool_offset();
  out->grad_pool_bytes = resp.grad_pool_bytes();
  out->slots.clear();
  for (const auto& sl : resp.slots()) {
    out->slots.push_back(ParameterSlots{sl.param_id(), sl.grad_offset(), sl.param_offset(),
                                        sl.numel(), sl.sum_offset()});
  }
  return Status::Ok();
}

Status Session::AllocateRegion(uint64_t bytes, const std::string& label,
                               std::unique_ptr<MappedRegion>* out) {
  v1::AllocateRegionRequest req;
  req.set_session_id(impl_->id);
  req.set_session_token(impl_->token);
  req.set_bytes(bytes);
  req.set_kind(v1::SEGMENT_KIND_SESSION);
  req.set_label(label);
  grpc::ClientContext ctx;
  PrepareCall(impl_->target, &ctx, kUnaryTimeoutS);
  v1::AllocateRegionResponse resp;
  Status s = FromGrpc(impl_->stub->AllocateRegion(&ctx, req, &resp), impl_->socket_path);
  if (!s.ok()) return s;
  return MappedRegion::Map(impl_->shm_dir, ToInfo(resp.region()), out);
}

Status Session::FreeRegion(uint64_t region_id, uint64_t* bytes_freed) {
  v1::FreeRegionRequest req;
  req.set_session_id(impl_->id);
  req.set_session_token(impl_->token);
  req.set_region_id(region_id);
  grpc::ClientContext ctx;
  PrepareCall(impl_->target, &ctx, kUnaryTimeoutS);
  v1::FreeRegionResponse resp;
  Status s = FromGrpc(impl_->stub->FreeRegion(&ctx, req, &resp), impl_->socket_path);
  if (s.ok() && bytes_freed != nullptr) *bytes_freed = resp.bytes_freed();
  return s;
}

}  // namespace trainstream
