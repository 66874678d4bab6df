#include "sessions/session_registry.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "memory/client_memory_guard.h"
#include "planes/optimizer_service.h"
#include "security/token.h"
#include "sessions/group_registry.h"
#include "sessions/param_binding.h"
#include "trainstream/platform/mapping_faults.h"
#include "trainstream/platform/sys_call.h"
#include "trainstream/wire/segment_header.h"
#include "trainstream/wire/session_control.h"

namespace trainstream::daemon {
namespace {

constexpr uint64_t kPage = 4096;

Status Invalid(const std::string& msg) { return Status(StatusCode::kInvalidArgument, msg); }

SegmentOwner OwnerOf(const Session& s) {
  SegmentOwner owner;
  owner.session_id = s.id;
  owner.uid = s.creds.uid;
  owner.job = s.job;
  owner.rank = s.rank;
  owner.local_rank = s.local_rank;
  return owner;
}

}  // namespace

uint64_t MinControlBytes() { return wire::ControlLayoutFor(kRingCapacity).bytes; }

bool Session::Send(const v1::SessionEvent& event) {
  std::lock_guard<std::mutex> lock(stream_mu);
  if (stream == nullptr) return false;
  return stream->Write(event);
}

uint64_t Session::BytesHeld() {
  std::lock_guard<std::mutex> lock(regions_mu);
  uint64_t total = 0;
  for (auto& [id, r] : regions) total += r.segment->size();
  return total;
}

SessionRegistry::SessionRegistry(const DaemonConfig& config, Budget* budget,
                                 OptimizerService* optimizer)
    : config_(config), budget_(budget), optimizer_(optimizer) {
  if (Status st = ClientMemoryGuard::Install(); !st.ok())
    spdlog::error("cannot guard client memory (Note [Client pages can vanish]): {}", st.message());
  optimizer_->SetFaultHandler([this](uint64_t id, const std::string& why) { EndLater(id, why); });
  memory_.create = [this](uint32_t kind, uint64_t bytes, const std::string& what,
                          const SegmentOwner& owner, std::unique_ptr<ShmSegment>* out) {
    return CreateSegment(owner, kind, bytes, what, out);
  };
  memory_.drop = [this](std::unique_ptr<ShmSegment> seg) { DropSegment(std::move(seg)); };
  memory_.recovery = RecoveryLayoutOptions{config_.recovery_grace_s > 0, kPlaneChunkElems,
                                           optimizer_->worker_threads()};
  groups_ = std::make_unique<GroupRegistry>(&memory_, optimizer_);
  if (config_.recovery_grace_s > 0) {
    AdoptionHooks hooks;
    hooks.reserve = [this](uint64_t bytes, const std::string& what) {
      return budget_->Reserve(bytes, what);
    };
    hooks.release = [this](uint64_t bytes) { budget_->Release(bytes); };
    hooks.held = [this](const ShmSegment& seg) {
      if (seg.locked()) pinned_bytes_.fetch_add(seg.size());
    };
    hooks.drop = [this](std::unique_ptr<ShmSegment> seg) { DropSegment(std::move(seg)); };
    adopted_ = std::make_unique<AdoptionStore>(std::move(hooks), config_.lock_memory,
                                               config_.recovery_grace_s);
  }
  if (int err = platform::WakeEvent::Create(&reaper_wake_); err != 0) {
    // Only at startup, out of descriptors or handles: a registry without its
    // reaper would never end a session.
    spdlog::critical("cannot create the session reaper's wake-up: {}", platform::ErrnoMessage(err));
    std::abort();
  }
  reaper_ = std::thread([this] { ReaperLoop(); });
}

SessionRegistry::~SessionRegistry() {
  {
    std::lock_guard<std::mutex> lock(reap_mu_);
    reaper_stop_ = true;
  }
  reaper_wake_->Set();
  reaper_.join();
  EndAll("daemon exiting");
  adopted_.reset();
  groups_.reset();  // before the budget and segments' owners go
}

AdoptionStore::Scan SessionRegistry::AdoptPrevious(const std::string& dir, const std::string& tag) {
  if (!adopted_) return {};
  return adopted_->AdoptFrom(dir, tag);
}

void SessionRegistry::SweepAdopted() {
  if (adopted_) adopted_->Sweep();
}

size_t SessionRegistry::adopted_waiting() { return adopted_ ? adopted_->size() : 0; }

void SessionRegistry::EndLater(uint64_t session_id, const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(reap_mu_);
    reap_queue_.emplace_back(session_id, reason);
  }
  reaper_wake_->Set();
}

void SessionRegistry::ReaperLoop() {
  platform::WakeEvent* const faults = ClientMemoryGuard::FaultEvent();
  for (;;) {
    if (platform::WakeEvent::WaitEither(reaper_wake_.get(), faults) != 0) return;
    reaper_wake_->Clear();
    std::vector<std::pair<uint64_t, std::string>> work;
    {
      std::lock_guard<std::mutex> lock(reap_mu_);
      if (reaper_stop_) return;
      work.swap(reap_queue_);
    }
    // Note [Client pages can vanish] (client_memory_guard.h).
    for (uint64_t owner : ClientMemoryGuard::TakeFaults()) {
      if (owner == 0) {
        spdlog::warn(
            "a base segment's file was truncated under the daemon; its pages read as "
            "zeros until the base is dropped");
        continue;
      }
      if (owner == kAdoptedOwner) {
        spdlog::warn(
            "an adopted staging segment was truncated before its client came back; that "
            "optimizer state cannot be resumed");  // its claim says so (AdoptionStore)
        continue;
      }
      work.emplace_back(owner,
                        "a shared-memory segment of this session was truncated while the daemon "
                        "used it; the daemon's copy of it is gone");
    }
    for (auto& [id, why] : work) End(id, why, true);
  }
}

void SessionRegistry::SetPidHooks(std::function<bool(uint64_t, pid_t)> watch,
                                  std::function<void(uint64_t)> unwatch) {
  watch_pid_ = std::move(watch);
  unwatch_pid_ = std::move(unwatch);
}

Status SessionRegistry::CreateSegment(const SegmentOwner& owner, uint32_t kind,
                                      uint64_t total_bytes, const std::string& what,
                                      std::unique_ptr<ShmSegment>* out) {
  Status st = budget_->Reserve(total_bytes, what);
  if (!st.ok()) return st;
  st = ShmSegment::Create(config_.shm_dir, kind, total_bytes, owner, config_.lock_memory, out);
  if (!st.ok()) {
    budget_->Release(total_bytes);
    return st;
  }
  if ((*out)->locked()) pinned_bytes_.fetch_add(total_bytes);
  return Status::Ok();
}

void SessionRegistry::DropSegment(std::unique_ptr<ShmSegment> seg) {
  if (!seg) return;
  const uint64_t bytes = seg->size();
  if (seg->locked()) pinned_bytes_.fetch_sub(bytes);
  seg.reset();  // unmaps and unlinks
  budget_->Release(bytes);
}

uint64_t SessionRegistry::AddRegion(Session& s, std::unique_ptr<ShmSegment> seg,
                                    const std::string& label, uint64_t length,
                                    bool client_freeable) {
  SessionRegion r;
  r.region_id = next_region_id_.fetch_add(1);
  r.segment = std::move(seg);
  r.label = label;
  r.offset = wire::kSegmentHeaderBytes;
  r.length = length;
  r.client_freeable = client_freeable;
  const uint64_t id = r.region_id;
  std::lock_guard<std::mutex> lock(s.regions_mu);
  s.regions.emplace(id, std::move(r));
  return id;
}

void SessionRegistry::FillRegion(const SessionRegion& r, v1::Region* out) const {
  out->set_region_id(r.region_id);
  out->set_segment_name(r.segment->name());
  out->set_offset(r.offset);
  out->set_length(r.length);
  out->set_segment_size(r.segment->size());
  out->set_kind(static_cast<v1::SegmentKind>(r.segment->kind()));
  out->set_read_only(r.segment->kind() == v1::SEGMENT_KIND_BASE);
}

Status SessionRegistry::Create(const PeerCredentials& creds, const v1::AttachRequest& req,
                               SessionStream* stream, std::shared_ptr<Session>* out,
                               v1::Attached* attached) {
  if (req.protocol_version() > 1) {
    return Status(StatusCode::kFailedPrecondition,
                  "attach.protocol_version: " + std::to_string(req.protocol_version()) +
                      " is newer than this daemon speaks (1); upgrade trainstreamd");
  }
  if (req.job().size() >= sizeof(wire::SegmentHeader::job)) {
    return Invalid("attach.job: " + std::to_string(req.job().size()) + " bytes (at most " +
                   std::to_string(sizeof(wire::SegmentHeader::job) - 1) + ")");
  }
  uint64_t control_bytes = MinControlBytes();
  if (req.control_bytes() != 0) {
    if (req.control_bytes() < control_bytes || req.control_bytes() > kMaxControlBytes) {
      return Invalid("attach.control_bytes: " + std::to_string(req.control_bytes()) +
                     " is out of range [" + std::to_string(control_bytes) + ", " +
                     std::to_string(kMaxControlBytes) + "] (0 takes the default)");
    }
    control_bytes = AlignUp(req.control_bytes(), kPage);
  }
  if (req.has_group()) {
    if (Status st = GroupRegistry::Validate(req.group()); !st.ok()) return st;
  }
  if (req.pid() != 0 && req.pid() != creds.pid) {
    spdlog::warn("attach: client says pid {}, SO_PEERCRED says {} (pid namespaces?); using {}",
                 req.pid(), creds.pid, creds.pid);
  }

  auto s = std::make_shared<Session>();
  s->token = RandomHex(16);
  s->creds = creds;
  s->job = req.job();
  s->rank = req.rank();
  s->local_rank = req.local_rank();
  s->group = req.has_group() ? req.group().key() : "";
  s->started = std::chrono::steady_clock::now();
  std::unique_ptr<AdoptedState> resumed;
  if (req.has_resume()) {
    // Note [Optimizer state outlives the daemon]: the state goes only to the
    // uid that registered it, showing the token whose hash it holds.
    if (!adopted_) {
      return Status(StatusCode::kNotFound,
                    "resume: recovery is off in this daemon (recovery_grace = 0): it adopted "
                    "no optimizer state");
    }
    const std::string& token = req.resume().recovery_token();
    if (token.size() != 32) return Invalid("resume.recovery_token: expected 32 hex digits");
    // A group's state is claimed by its first rank back (GroupRegistry::Rejoin).
    if (!req.has_group()) {
      if (Status st = adopted_->Claim(ProofOf(token), creds.uid, &resumed); !st.ok()) return st;
    }
    s->recovery_token = token;
  } else if (config_.recovery_grace_s > 0) {
    s->recovery_token = RandomHex(16);
  }
  if (!s->recovery_token.empty()) {
    s->owner_proof = ProofOf(s->recovery_token);
    s->owner_start = ProcessStartTime(creds.pid);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    size_t held = 0;
    for (const auto& [id, other] : sessions_) held += other->creds.uid == creds.uid ? 1 : 0;
    if (held >= kMaxSessionsPerUid) {
      return Status(StatusCode::kResourceExhausted,
                    "uid " + std::to_string(creds.uid) + " already holds " + std::to_string(held) +
                        " sessions, the most one uid may (" + std::to_string(kMaxSessionsPerUid) +
                        "); detach some first");
    }
    s->id = next_session_id_++;
  }

  std::unique_ptr<ShmSegment> seg;
  Status st =
      CreateSegment(OwnerOf(*s), v1::SEGMENT_KIND_SESSION,
                    wire::kSegmentHeaderBytes + control_bytes, "the session control region", &seg);
  if (!st.ok()) return st;
  // SessionControlHeader, then the command ring, then the completion ring.
  // Note [Rings a client can write]: the layout is kept here and never read back.
  char* base = seg->base() + wire::kSegmentHeaderBytes;
  const wire::ControlLayout layout =
      wire::InitializeControlRegion(base, s->id, control_bytes, kRingCapacity);
  s->rings =
      ControlRings{base, layout.command_ring_offset, layout.completion_ring_offset, kRingCapacity};

  {
    std::lock_guard<std::mutex> lock(s->mu);
    s->control_region_id = AddRegion(*s, std::move(seg), "control", control_bytes, false);
  }
  {
    std::lock_guard<std::mutex> lock(s->stream_mu);
    s->stream = stream;
  }
  attached->set_session_id(s->id);
  attached->set_session_token(s->token);
  attached->set_shm_dir(config_.shm_dir);
  attached->set_recovery_token(s->recovery_token);
  {
    std::lock_guard<std::mutex> lock(s->regions_mu);
    FillRegion(s->regions.at(s->control_region_id), attached->mutable_control());
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    sessions_[s->id] = s;
  }
  std::weak_ptr<Session> weak = s;
  RegionResolver resolver = [weak](uint64_t region_id, uint64_t offset, uint64_t bytes) -> void* {
    auto sp = weak.lock();
    if (!sp) return nullptr;
    std::lock_guard<std::mutex> lock(sp->regions_mu);
    auto it = sp->regions.find(region_id);
    if (it == sp->regions.end() || it->second.segment->kind() != v1::SEGMENT_KIND_SESSION)
      return nullptr;
    const SessionRegion& r = it->second;
    if (offset > r.length || bytes > r.length - offset) return nullptr;
    return r.segment->base() + r.offset + offset;
  };
  if (!s->group.empty()) {
    // A group member's rings are served by its group's plane, not its own.
    GroupJoiner joiner{s->id, creds.pid, creds.uid, s->job, s->rings, std::move(resolver)};
    Status st = req.has_resume() ? groups_->Rejoin(joiner, req.group(), s->owner_proof,
                                                   adopted_.get(), attached->mutable_resumed())
                                 : groups_->Join(joiner, req.group());
    if (!st.ok()) {
      // A resuming rank hears why from the attach's own status (every rank the same).
      End(s->id, req.has_resume() ? "could not resume its group" : "could not join its group",
          !req.has_resume());
      return st;
    }
    if (req.has_resume()) {
      std::lock_guard<std::mutex> lock(s->mu);
      for (const auto& reg : attached->resumed().registrations())
        for (const auto& p : reg.params()) s->param_ids.insert(p.param_id());
      s->registrations = 1;
    }
  } else {
    PlaneOptions options;
    options.name = "session " + std::to_string(s->id);
    optimizer_->StartPlane(s->id, std::move(options),
                           {PlaneMember{0, s->id, s->rings, std::move(resolver)}});
  }
  if (resumed) {
    if (Status st = Resume(*s, std::move(resumed), attached->mutable_resumed()); !st.ok()) {
      End(s->id, "could not resume its optimizer state", false);
      return st;
    }
  }
  // A client that died before this point is noticed here (the pidfd cannot be
  // opened) and its session ends at once.
  if (watch_pid_ && !watch_pid_(s->id, creds.pid)) {
    End(s->id, "client process " + std::to_string(creds.pid) + " is gone", true);
    return Status(StatusCode::kUnavailable, "client process exited during attach");
  }
  spdlog::info("session {} attached: pid={} uid={} job='{}' rank={} control={}", s->id, creds.pid,
               creds.uid, s->job, s->rank, attached->control().segment_name());
  *out = std::move(s);
  return Status::Ok();
}

Status SessionRegistry::Resume(Session& s, std::unique_ptr<AdoptedState> state,
                               v1::ResumedState* out) {
  const auto now = std::chrono::steady_clock::now();
  out->set_waited_s(std::chrono::duration<double>(now - state->adopted).count());
  out->set_completed_step(state->step.completed_step);
  out->set_completed_grad_norm(state->step.completed_grad_norm);
  out->set_completed_status(state->step.completed_status);
  out->set_completed_params_updated(state->step.completed_params_updated);
  std::lock_guard<std::mutex> lock(s.mu);
  Status result;
  for (AdoptedRegistration& adopted : state->registrations) {
    Registration reg = ResumeRegistration(std::move(adopted), state->step, /*group_ranks=*/0);
    out->set_restored_subchunks(out->restored_subchunks() + reg.report.restored_subchunks);
    out->set_rolled_forward(out->rolled_forward() + reg.report.rolled_forward);
    if (!result.ok()) {
      DropRegistration(memory_, reg);
      continue;
    }
    // The new client owns it now: a later crash is recovered the same way.
    SetOwner(reg, s.id, s.creds.pid, s.owner_start);
    v1::ResumedRegistration* rr = out->add_registrations();
    FillSlots(reg, 0, rr);
    result = Bind(s, std::move(reg), rr->mutable_staging());
  }
  if (result.ok()) {
    spdlog::info(
        "session {} resumed the optimizer state of job '{}' ({} registrations, {} parameters "
        "finished on adoption, {} sub-chunks restored) after {:.2f} s",
        s.id, state->job, out->registrations_size(), out->rolled_forward(),
        out->restored_subchunks(), out->waited_s());
  }
  return result;
}

Status SessionRegistry::Find(uint64_t session_id, const std::string& token,
                             const PeerCredentials& caller, std::shared_ptr<Session>* out) {
  std::shared_ptr<Session> s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = sessions_.find(session_id);
    if (it != sessions_.end()) s = it->second;
  }
  if (!s) {
    return Status(StatusCode::kNotFound, "session_id: no session " + std::to_string(session_id) +
                                             " (it ended or never existed; attach first)");
  }
  if (!ConstantTimeEquals(token, s->token)) {
    return Status(StatusCode::kPermissionDenied,
                  "session_token: does not match session " + std::to_string(session_id));
  }
  if (caller.uid != s->creds.uid && caller.uid != 0) {
    return Status(StatusCode::kPermissionDenied,
                  "session " + std::to_string(session_id) + " belongs to uid " +
                      std::to_string(s->creds.uid) + ", not to uid " + std::to_string(caller.uid));
  }
  *out = std::move(s);
  return Status::Ok();
}

void SessionRegistry::End(uint64_t session_id, const std::string& reason, bool cancel_stream) {
  std::shared_ptr<Session> s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = sessions_.find(session_id);
    if (it == sessions_.end()) return;
    s = std::move(it->second);
    sessions_.erase(it);
  }
  if (unwatch_pid_) unwatch_pid_(session_id);
  {
    std::lock_guard<std::mutex> lock(s->stream_mu);
    if (cancel_stream && s->stream != nullptr) {
      // The reason reaches the client (Session::alive) before the stream closes.
      v1::SessionEvent event;
      event.mutable_notice()->set_kind(v1::DaemonNotice::KIND_SESSION_ENDED);
      event.mutable_notice()->set_message("session " + std::to_string(session_id) +
                                          " ended by the daemon: " + reason);
      s->stream->Write(event);
      s->stream->Cancel();
    }
    s->stream = nullptr;
  }
  uint64_t freed = 0;
  std::lock_guard<std::mutex> lock(s->mu);
  s->closed = true;
  {
    // Tell a client blocked on its completion ring (and the optimizer's
    // consumer of the command ring) that the session is going away.
    // Note [Rings a client can write]: the daemon's copy of the layout.
    std::lock_guard<std::mutex> rlock(s->regions_mu);
    if (s->regions.count(s->control_region_id) != 0) {
      s->rings.header()->closing.store(1, std::memory_order_release);
      WakeRing(s->rings.command_ring());
      WakeRing(s->rings.completion_ring());
    }
  }
  // Before any of the session's memory is unmapped (optimizer_service.h,
  // group_registry.h).
  optimizer_->StopPlane(session_id);  // a group member's plane is its group's
  if (groups_ && !s->group.empty()) groups_->Leave(session_id, reason);
  std::map<uint64_t, SessionRegion> regions;
  {
    std::lock_guard<std::mutex> rlock(s->regions_mu);
    regions.swap(s->regions);
  }
  for (auto& [id, r] : regions) {
    freed += r.segment->size();
    DropSegment(std::move(r.segment));
  }
  for (auto& r : s->retired) {
    freed += r.segment->size();
    DropSegment(std::move(r.segment));
  }
  s->retired.clear();
  for (const auto& hook : end_hooks_) hook(session_id);
  spdlog::info("session {} ended ({}): pid={} uid={} freed {} bytes", session_id, reason,
               s->creds.pid, s->creds.uid, freed);
}

void SessionRegistry::EndAll(const std::string& reason) {
  std::vector<uint64_t> ids;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, s] : sessions_) ids.push_back(id);
  }
  for (uint64_t id : ids) End(id, reason, false);
}

void SessionRegistry::NotifyAll(const v1::DaemonNotice& notice) {
  std::vector<std::shared_ptr<Session>> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, s] : sessions_) all.push_back(s);
  }
  v1::SessionEvent event;
  *event.mutable_notice() = notice;
  for (auto& s : all) s->Send(event);
}

size_t SessionRegistry::size() {
  std::lock_guard<std::mutex> lock(mu_);
  return sessions_.size();
}

uint64_t SessionRegistry::pinned_bytes() const { return pinned_bytes_.load(); }

Status SessionRegistry::RegisterParameters(Session& s, const v1::RegisterParametersRequest& req,
                                           v1::RegisterParametersResponse* resp) {
  if (!s.group.empty()) {
    // Not under s.mu: the group barrier waits for the other local ranks, and
    // End (which holds s.mu) must be able to break the group meanwhile.
    {
      std::lock_guard<std::mutex> lock(s.mu);
      if (s.closed) return Status(StatusCode::kNotFound, "session_id: the session has ended");
    }
    Status st = groups_->Register(s.id, req, resp);
    if (!st.ok()) return st;
    std::lock_guard<std::mutex> lock(s.mu);
    for (const auto& p : req.params()) s.param_ids.insert(p.param_id());
    return st;
  }
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.closed) return Status(StatusCode::kNotFound, "session_id: the session has ended");
  if (Status st = ValidateRegistration(req, s.param_ids); !st.ok()) return st;
  RecoveryOwner client;
  std::copy(s.owner_proof.begin(), s.owner_proof.end(), client.proof);
  client.uid = s.creds.uid;
  client.pid = s.creds.pid;
  client.start = s.owner_start;
  client.registration = s.registrations;
  Registration reg;
  if (Status st = CreateRegistration(memory_, req, /*group_ranks=*/0, OwnerOf(s), client,
                                     std::to_string(req.params_size()) + " parameters", &reg);
      !st.ok())
    return st;
  FillSlots(reg, 0, resp);
  const uint64_t staging_bytes = reg.staging->size(), state_bytes = reg.state->size();
  if (Status st = Bind(s, std::move(reg), resp->mutable_staging()); !st.ok()) return st;
  spdlog::info("session {}: registered {} parameters (staging {} bytes, state {} bytes)", s.id,
               req.params_size(), staging_bytes, state_bytes);
  return Status::Ok();
}

Status SessionRegistry::Bind(Session& s, Registration reg, v1::Region* staging) {
  if (Status st = optimizer_->AddParameters(s.id, BindState(reg)); !st.ok()) {
    DropRegistration(memory_, reg);
    return st;
  }
  for (const CheckedParam& p : reg.view.params) s.param_ids.insert(p.param_id);
  const uint64_t state_length = reg.state->size() - wire::kSegmentHeaderBytes;
  const uint64_t staging_length = reg.staging->size() - wire::kSegmentHeaderBytes;
  AddRegion(s, std::move(reg.state), "optimizer-state", state_length, false);
  staging->set_region_id(AddRegion(s, std::move(reg.staging), "staging", staging_length, false));
  ++s.registrations;
  return Status::Ok();
}

Status SessionRegistry::AllocateRegion(Session& s, const v1::AllocateRegionRequest& req,
                                       v1::Region* out) {
  if (req.kind() != v1::SEGMENT_KIND_SESSION && req.kind() != v1::SEGMENT_KIND_UNSPECIFIED) {
    return Invalid("kind: clients may only allocate SEGMENT_KIND_SESSION regions (got " +
                   std::to_string(req.kind()) + ")");
  }
  if (req.bytes() == 0) return Invalid("bytes: must be > 0");
  if (req.bytes() > config_.max_region_bytes) {
    return Invalid("bytes: " + std::to_string(req.bytes()) + " exceeds the per-region limit of " +
                   std::to_string(config_.max_region_bytes) + " bytes (max_region_bytes)");
  }
  if (req.label().size() > 256) return Invalid("label: longer than 256 bytes");
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.closed) return Status(StatusCode::kNotFound, "session_id: the session has ended");
  {
    std::lock_guard<std::mutex> rlock(s.regions_mu);
    if (s.regions.size() + s.retired.size() >= kMaxRegionsPerSession) {
      return Status(StatusCode::kResourceExhausted,
                    "session " + std::to_string(s.id) + " holds " +
                        std::to_string(s.regions.size() + s.retired.size()) +
                        " regions, the most one session may (" +
                        std::to_string(kMaxRegionsPerSession) +
                        "); free some (FreeRegion) or use fewer, larger ones");
    }
  }
  const uint64_t total = wire::kSegmentHeaderBytes + AlignUp(req.bytes(), kPage);
  std::unique_ptr<ShmSegment> seg;
  Status st =
      CreateSegment(OwnerOf(s), v1::SEGMENT_KIND_SESSION, total,
                    "region '" + req.label() + "' of session " + std::to_string(s.id), &seg);
  if (!st.ok()) return st;
  const uint64_t id = AddRegion(s, std::move(seg), req.label(), req.bytes(), true);
  std::lock_guard<std::mutex> rlock(s.regions_mu);
  FillRegion(s.regions.at(id), out);
  return Status::Ok();
}

Status SessionRegistry::FreeRegion(Session& s, const v1::FreeRegionRequest& req,
                                   uint64_t* bytes_freed) {
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.closed) return Status(StatusCode::kNotFound, "session_id: the session has ended");
  SessionRegion region;
  {
    std::lock_guard<std::mutex> rlock(s.regions_mu);
    auto it = s.regions.find(req.region_id());
    if (it == s.regions.end()) {
      return Invalid("region_id: " + std::to_string(req.region_id()) +
                     " is not a region of session " + std::to_string(s.id));
    }
    if (!it->second.client_freeable) {
      return Invalid("region_id: " + std::to_string(req.region_id()) + " is the session's " +
                     it->second.label + " region; it lives as long as the session");
    }
    region = std::move(it->second);
    s.regions.erase(it);
  }
  *bytes_freed = region.segment->size();
  if (!s.param_ids.empty()) {
    // The optimizer (the session's or its group's) may still be copying from
    // it (a kLoadState/kExportState of a registered parameter in flight):
    // remove the name now, keep the mapping (and its budget) until teardown.
    region.segment->Unlink();
    s.retired.push_back(std::move(region));
    *bytes_freed = 0;
  } else {
    DropSegment(std::move(region.segment));
  }
  return Status::Ok();
}

void SessionRegistry::FillStatus(v1::StatusResponse* out) {
  std::vector<std::shared_ptr<Session>> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, s] : sessions_) all.push_back(s);
  }
  const auto now = std::chrono::steady_clock::now();
  for (auto& s : all) {
    auto* ss = out->add_sessions();
    ss->set_session_id(s->id);
    ss->set_pid(s->creds.pid);
    ss->set_uid(s->creds.uid);
    ss->set_job(s->job);
    ss->set_rank(s->rank);
    ss->set_local_rank(s->local_rank);
    ss->set_age_s(std::chrono::duration<double>(now - s->started).count());
    ss->set_group(s->group);
    {
      std::lock_guard<std::mutex> lock(s->mu);
      ss->set_params(s->param_ids.size());
    }
    uint64_t held = 0;
    std::lock_guard<std::mutex> rlock(s->regions_mu);
    for (auto& [id, r] : s->regions) {
      held += r.segment->size();
      auto* seg = out->add_segments();
      seg->set_name(r.segment->name());
      seg->set_kind(static_cast<v1::SegmentKind>(r.segment->kind()));
      seg->set_bytes(r.segment->size());
      seg->set_session_id(s->id);
      seg->set_label(r.label);
    }
    ss->set_bytes_held(held);
  }
  groups_->FillStatus(out);
  if (adopted_) adopted_->FillStatus(out);
}

}  // namespace trainstream::daemon
