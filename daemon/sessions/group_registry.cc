#include "sessions/group_registry.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <set>
#include <vector>

#include "planes/optimizer_service.h"
#include "recovery/owner.h"
#include "security/token.h"
#include "trainstream/platform/user.h"

namespace trainstream::daemon {
namespace {

Status Invalid(const std::string& msg) { return Status(StatusCode::kInvalidArgument, msg); }
Status Precondition(const std::string& msg) { return Status(StatusCode::kFailedPrecondition, msg); }

std::string Shape(const v1::ParameterSpec& p) {
  std::string s = "[";
  for (int d = 0; d < p.shape_size(); ++d) s += (d ? ", " : "") + std::to_string(p.shape(d));
  return s + "]";
}

// "" when `b` (local rank rb) registers what `a` (local rank ra) did, else what differs.
std::string DiffRegistration(const v1::RegisterParametersRequest& a, int ra,
                             const v1::RegisterParametersRequest& b, int rb) {
  const std::string A = "local rank " + std::to_string(ra), B = "local rank " + std::to_string(rb);
  if (a.params_size() != b.params_size()) {
    return B + " registers " + std::to_string(b.params_size()) + " parameters, " + A + " " +
           std::to_string(a.params_size());
  }
  for (int i = 0; i < a.params_size(); ++i) {
    const auto& p = a.params(i);
    const auto& q = b.params(i);
    const std::string what = "parameter " + std::to_string(i) + " ('" + p.name() + "'): ";
    auto both = [&](const std::string& x, const std::string& y) {
      return x + " on " + B + ", " + y + " on " + A;
    };
    if (p.name() != q.name())
      return what + "named " + both("'" + q.name() + "'", "'" + p.name() + "'");
    if (p.param_id() != q.param_id())
      return what + "id " + both(std::to_string(q.param_id()), std::to_string(p.param_id()));
    if (Shape(p) != Shape(q)) return what + "shape " + both(Shape(q), Shape(p));
    if (p.dtype() != q.dtype() || p.grad_dtype() != q.grad_dtype())
      return what + "dtypes differ between " + A + " and " + B;
    if (p.group() != q.group()) return what + "parameter groups differ between " + A + " and " + B;
  }
  if (a.groups_size() != b.groups_size()) return B + " has a different number of parameter groups";
  for (int g = 0; g < a.groups_size(); ++g) {
    const auto& x = a.groups(g);
    const auto& y = b.groups(g);
    if (x.lr() != y.lr() || x.beta1() != y.beta1() || x.beta2() != y.beta2() ||
        x.eps() != y.eps() || x.weight_decay() != y.weight_decay()) {
      return "parameter group " + std::to_string(g) +
             ": hyper-parameters (lr, betas, eps, weight_decay) differ between " + A + " and " + B;
    }
  }
  if (a.moment_dtype() != b.moment_dtype())
    return "moment_dtype differs between " + A + " and " + B;
  if (a.max_grad_norm() != b.max_grad_norm())
    return "max_grad_norm differs between " + A + " and " + B;
  if (a.seed() != b.seed()) return "seed differs between " + A + " and " + B;
  return "";
}

}  // namespace

class Group {
 public:
  enum class State { kForming, kResuming, kRunning, kBroken };
  struct Member {
    GroupJoiner joiner;
    bool registered = false;
    std::string checksum;
  };

  // Set at creation, then read-only.
  platform::UserId uid = 0;
  std::string key;
  std::string job;
  v1::GroupMembership membership;  // local_rank is the first joiner's; unused
  double timeout_s = kDefaultGroupTimeoutS;

  std::mutex mu;
  std::condition_variable cv;          // Register's barrier
  std::map<int32_t, Member> members;   // Guarded by mu: by local rank
  State state = State::kForming;       // Guarded by mu.
  std::string broken_reason;           // Guarded by mu.
  bool have_spec = false;              // Guarded by mu.
  v1::RegisterParametersRequest spec;  // Guarded by mu: the first registration
  int32_t spec_rank = 0;               // Guarded by mu.
  int32_t registered = 0;              // Guarded by mu.
  Registration reg;                    // Guarded by mu: formed, or resuming
  uint64_t plane = 0;                  // Guarded by mu: its plane's id while running
  // Recovery (docs/recovery.md). Guarded by mu.
  std::string recovery_token;  // handed to every rank at registration ("" : off)
  OwnerProof proof{};          // resuming: what every rank must show
  wire::StepRecord step{};     // resuming: the last step done
  double waited_s = 0;

  Member* FindSession(uint64_t session_id, int32_t* rank) {
    for (auto& [r, m] : members) {
      if (m.joiner.session_id == session_id) {
        *rank = r;
        return &m;
      }
    }
    return nullptr;
  }
};

GroupRegistry::GroupRegistry(const StateMemory* memory, OptimizerService* planes)
    : memory_(memory), planes_(planes) {}

std::set<std::shared_ptr<Group>> GroupRegistry::AllGroups() {
  std::set<std::shared_ptr<Group>> all;
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [k, g] : groups_) all.insert(g);
  for (auto& [s, g] : by_session_) all.insert(g);
  return all;
}

GroupRegistry::~GroupRegistry() {
  for (const auto& g : AllGroups()) {
    std::lock_guard<std::mutex> lock(g->mu);
    if (g->state != Group::State::kBroken) Break(*g, "the daemon is shutting down", -1);
  }
}

Status GroupRegistry::Validate(const v1::GroupMembership& m) {
  if (m.key().empty() || m.key().size() > kMaxGroupKeyBytes) {
    return Invalid("attach.group.key: " + std::to_string(m.key().size()) +
                   " bytes; accepted: 1 to " + std::to_string(kMaxGroupKeyBytes));
  }
  if (m.local_world_size() < 1 || m.local_world_size() > kMaxLocalWorldSize) {
    return Invalid("attach.group.local_world_size: " + std::to_string(m.local_world_size()) +
                   "; accepted: 1 to " + std::to_string(kMaxLocalWorldSize));
  }
  if (m.local_rank() < 0 || m.local_rank() >= m.local_world_size()) {
    return Invalid("attach.group.local_rank: " + std::to_string(m.local_rank()) +
                   "; accepted: 0 to local_world_size - 1 (" +
                   std::to_string(m.local_world_size() - 1) + ")");
  }
  if (m.nnodes() < 1 || m.node_rank() < 0 || m.node_rank() >= m.nnodes()) {
    return Invalid("attach.group.node_rank / nnodes: " + std::to_string(m.node_rank()) + " / " +
                   std::to_string(m.nnodes()) + "; accepted: nnodes >= 1, 0 <= node_rank < nnodes");
  }
  if (m.world_size() < m.local_world_size() || m.world_size() < m.nnodes()) {
    return Invalid("attach.group.world_size: " + std::to_string(m.world_size()) +
                   "; accepted: at least local_world_size and nnodes");
  }
  if (!std::isfinite(m.timeout_s()) || m.timeout_s() < 0 || m.timeout_s() > 86400) {
    return Invalid("attach.group.timeout_s: accepted: 0 (the default, 60 s) to 86400");
  }
  return Status::Ok();
}

Status GroupRegistry::Join(const GroupJoiner& joiner, const v1::GroupMembership& m) {
  if (auto st = Validate(m); !st.ok()) return st;
  std::lock_guard<std::mutex> lock(mu_);
  std::shared_ptr<Group>& slot = groups_[{joiner.uid, m.key()}];
  if (!slot) {
    slot = std::make_shared<Group>();
    slot->uid = joiner.uid;
    slot->key = m.key();
    slot->job = joiner.job;
    slot->membership = m;
    slot->timeout_s = m.timeout_s() > 0 ? m.timeout_s() : kDefaultGroupTimeoutS;
  }
  Group& g = *slot;
  std::lock_guard<std::mutex> glock(g.mu);
  const std::string name = "group '" + g.key + "'";
  if (g.state != Group::State::kForming) {
    return Precondition(name +
                        " has already formed (its ranks are training); a rank cannot join "
                        "it later: restart the whole job");
  }
  const auto& have = g.membership;
  if (m.local_world_size() != have.local_world_size() || m.nnodes() != have.nnodes() ||
      m.node_rank() != have.node_rank() || m.world_size() != have.world_size()) {
    return Invalid(
        name + ": this rank says local_world_size=" + std::to_string(m.local_world_size()) +
        " nnodes=" + std::to_string(m.nnodes()) + " node_rank=" + std::to_string(m.node_rank()) +
        " world_size=" + std::to_string(m.world_size()) + ", the group's first rank " +
        std::to_string(have.local_world_size()) + ", " + std::to_string(have.nnodes()) + ", " +
        std::to_string(have.node_rank()) + ", " + std::to_string(have.world_size()));
  }
  auto it = g.members.find(m.local_rank());
  if (it != g.members.end()) {
    return Status(StatusCode::kAlreadyExists,
                  name + ": local rank " + std::to_string(m.local_rank()) +
                      " is already attached (session " +
                      std::to_string(it->second.joiner.session_id) + ", pid " +
                      std::to_string(it->second.joiner.pid) +
                      "); two jobs with one key? Pass a distinct job= to wrap()");
  }
  g.members[m.local_rank()].joiner = joiner;
  by_session_[joiner.session_id] = slot;
  spdlog::info("{}: local rank {} joined (session {}, pid {}), {} of {}", name, m.local_rank(),
               joiner.session_id, joiner.pid, g.members.size(), have.local_world_size());
  return Status::Ok();
}

Status GroupRegistry::Register(uint64_t session_id, const v1::RegisterParametersRequest& req,
                               v1::RegisterParametersResponse* resp) {
  std::shared_ptr<Group> gp;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = by_session_.find(session_id);
    if (it != by_session_.end()) gp = it->second;
  }
  if (!gp) return Precondition("session " + std::to_string(session_id) + " is in no group");
  Group& g = *gp;
  Status result = Status::Ok();
  {
    std::unique_lock<std::mutex> lock(g.mu);
    const std::string name = "group '" + g.key + "'";
    int32_t rank = -1;
    Group::Member* me = g.FindSession(session_id, &rank);
    if (g.state == Group::State::kBroken || me == nullptr) {
      return Precondition(name + " is broken: " + g.broken_reason);
    }
    if (me->registered) {
      return Precondition(name + ": local rank " + std::to_string(rank) +
                          " registered its parameters already; a data-parallel group registers "
                          "every parameter once, in wrap() (add_param_group afterwards is not "
                          "supported)");
    }
    if (Status st = ValidateRegistration(req, {}); !st.ok()) {
      Break(g, "local rank " + std::to_string(rank) + ": " + st.message(), -1);
      result = st;
    } else if (!g.have_spec) {
      g.spec = req;
      g.spec.clear_session_id();
      g.spec.clear_session_token();
      g.spec.clear_weights_checksum();
      g.spec_rank = rank;
      g.have_spec = true;
    } else if (std::string diff = DiffRegistration(g.spec, g.spec_rank, req, rank); !diff.empty()) {
      const std::string why = "the ranks registered different parameters: " + diff;
      Break(g, why, -1);
      result = Invalid(name + ": " + why);
    }
    if (result.ok()) {
      me->registered = true;
      me->checksum = req.weights_checksum();
      if (++g.registered == g.membership.local_world_size()) {
        result = Form(g);
        g.cv.notify_all();
      } else {
        const auto deadline =
            std::chrono::steady_clock::now() + std::chrono::duration<double>(g.timeout_s);
        while (g.state == Group::State::kForming) {
          if (g.cv.wait_until(lock, deadline) == std::cv_status::timeout &&
              g.state == Group::State::kForming) {
            std::string missing;
            for (int32_t r = 0; r < g.membership.local_world_size(); ++r) {
              auto it = g.members.find(r);
              if (it == g.members.end() || !it->second.registered)
                missing += (missing.empty() ? "" : ", ") + std::to_string(r);
            }
            Break(g,
                  "only " + std::to_string(g.registered) + " of " +
                      std::to_string(g.membership.local_world_size()) +
                      " local ranks registered within " + std::to_string(g.timeout_s) +
                      " s (missing local ranks: " + missing + ")",
                  -1);
          }
        }
      }
    }
    if (result.ok() && g.state == Group::State::kBroken) {
      result = Precondition(name + " is broken: " + g.broken_reason);
    }
    if (result.ok()) {
      // Region id 0: the group's, not the session's, never freed by a client.
      FillSlots(g.reg, rank, resp);
      resp->set_group_recovery_token(g.recovery_token);
    }
  }
  if (!result.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = groups_.find({g.uid, g.key});
    if (it != groups_.end() && it->second == gp) groups_.erase(it);
  }
  return result;
}

// The group's optimizer plane over its members' rings, serving g.reg (formed
// or resumed alike).
void GroupRegistry::StartPlane(Group& g, const std::string& name) {
  std::vector<PlaneMember> members;
  for (const auto& [r, m] : g.members)
    members.push_back(PlaneMember{r, m.joiner.session_id, m.joiner.rings, m.joiner.resolver});
  PlaneOptions options;
  options.name = name;
  options.group = true;
  options.world_size = static_cast<uint32_t>(g.membership.world_size());
  options.cross_node = g.membership.nnodes() > 1;
  g.plane = kGroupPlane | next_plane_.fetch_add(1);
  planes_->StartPlane(g.plane, std::move(options), std::move(members));
  // The plane's first parameters: nothing to disagree with.
  planes_->AddParameters(g.plane, BindState(g.reg));
  g.state = Group::State::kRunning;
}

Status GroupRegistry::Form(Group& g) {
  const std::string name = "group '" + g.key + "'";
  const std::string& reference = g.members.at(0).checksum;
  for (const auto& [r, m] : g.members) {
    if (m.checksum != reference) {
      std::string why = "local rank " + std::to_string(r) +
                        "'s initial weights differ from local rank 0's (checksum " +
                        m.checksum.substr(0, 16) + " vs " + reference.substr(0, 16) +
                        "); every rank must start from the same weights (seed the model the "
                        "same way, or load the same checkpoint, before wrap())";
      Break(g, why, -1);
      return Precondition(name + ": " + why);
    }
  }
  const auto ranks = static_cast<uint32_t>(g.membership.local_world_size());
  SegmentOwner owner;
  owner.uid = g.uid;
  owner.job = g.job;
  // Note [Optimizer state outlives the daemon]: the group's one state is
  // resumed by its ranks together, with a token they all hold.
  RecoveryOwner client;
  if (memory_->recovery.enabled) {
    g.recovery_token = RandomHex(16);
    const OwnerProof proof = ProofOf(g.recovery_token);
    std::copy(proof.begin(), proof.end(), client.proof);
    client.uid = g.uid;
    client.pid = g.members.at(0).joiner.pid;  // local rank 0: who it waits for
    client.start = ProcessStartTime(client.pid);
    client.world_size = static_cast<uint32_t>(g.membership.world_size());
    client.nnodes = static_cast<uint32_t>(g.membership.nnodes());
  }
  if (Status st = CreateRegistration(*memory_, g.spec, ranks, owner, client, name, &g.reg);
      !st.ok()) {
    Break(g, "could not allocate its memory: " + st.message(), -1);
    return st;
  }
  StartPlane(g, name);
  spdlog::info("{} formed: {} local ranks, {} parameters (state {} bytes, staging {} bytes)", name,
               ranks, g.spec.params_size(), g.reg.state->size(), g.reg.staging->size());
  return Status::Ok();
}

Status GroupRegistry::Rejoin(const GroupJoiner& joiner, const v1::GroupMembership& m,
                             const OwnerProof& proof, AdoptionStore* store, v1::ResumedState* out) {
  if (auto st = Validate(m); !st.ok()) return st;
  std::shared_ptr<Group> gp;
  {
    std::lock_guard<std::mutex> lock(mu_);
    std::shared_ptr<Group>& slot = groups_[{joiner.uid, m.key()}];
    if (!slot) {
      std::unique_ptr<AdoptedState> adopted;
      Status claimed = store->Claim(proof, joiner.uid, &adopted);
      if (claimed.ok() &&
          (adopted->registrations.size() != 1 || adopted->registrations[0].view.group_ranks !=
                                                     static_cast<uint32_t>(m.local_world_size()))) {
        claimed = Precondition("resume: that recovery token's state is not a group of " +
                               std::to_string(m.local_world_size()) + " local ranks");
        for (auto& r : adopted->registrations) {
          memory_->drop(std::move(r.staging));
          memory_->drop(std::move(r.state));
        }
      }
      if (!claimed.ok()) {
        groups_.erase({joiner.uid, m.key()});
        return claimed;
      }
      auto g = std::make_shared<Group>();
      g->uid = joiner.uid;
      g->key = m.key();
      g->job = joiner.job;
      g->membership = m;
      g->timeout_s = m.timeout_s() > 0 ? m.timeout_s() : kDefaultGroupTimeoutS;
      g->state = Group::State::kResuming;
      g->proof = proof;
      g->reg = ResumeRegistration(std::move(adopted->registrations[0]), adopted->step,
                                  static_cast<uint32_t>(m.local_world_size()));
      g->step = adopted->step;
      g->waited_s =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - adopted->adopted)
              .count();
      slot = g;
    }
    gp = slot;
  }
  Group& g = *gp;
  std::unique_lock<std::mutex> lock(g.mu);
  const std::string name = "group '" + g.key + "'";
  if (g.state != Group::State::kResuming ||
      !std::equal(proof.begin(), proof.end(), g.proof.begin()))
    return Precondition(name + " is not being resumed with this recovery token");
  const auto& have = g.membership;
  if (m.local_world_size() != have.local_world_size() || m.nnodes() != have.nnodes() ||
      m.node_rank() != have.node_rank() || m.world_size() != have.world_size())
    return Invalid(name + ": this rank's membership differs from the resuming group's");
  if (g.members.count(m.local_rank()) != 0) {
    return Status(StatusCode::kAlreadyExists,
                  name + ": local rank " + std::to_string(m.local_rank()) + " is back already");
  }
  g.members[m.local_rank()].joiner = joiner;
  g.members[m.local_rank()].registered = true;
  {
    std::lock_guard<std::mutex> glock(mu_);
    by_session_[joiner.session_id] = gp;
  }
  spdlog::info("{}: local rank {} re-attached to resume (session {}), {} of {}", name,
               m.local_rank(), joiner.session_id, g.members.size(), have.local_world_size());
  Status result;
  if (g.members.size() == static_cast<size_t>(have.local_world_size())) {
    // The ranks own it now: local rank 0 is who a later adoption waits for.
    const pid_t leader = g.members.at(0).joiner.pid;
    SetOwner(g.reg, 0, leader, ProcessStartTime(leader));
    StartPlane(g, name);
    spdlog::info("{} resumed: {} local ranks, {} parameters ({} finished on adoption)", name,
                 g.members.size(), g.reg.view.params.size(), g.reg.report.rolled_forward);
    g.cv.notify_all();
  } else {
    const auto deadline =
        std::chrono::steady_clock::now() + std::chrono::duration<double>(g.timeout_s);
    while (g.state == Group::State::kResuming) {
      if (g.cv.wait_until(lock, deadline) == std::cv_status::timeout &&
          g.state == Group::State::kResuming) {
        Break(g,
              "only " + std::to_string(g.members.size()) + " of " +
                  std::to_string(have.local_world_size()) + " local ranks came back within " +
                  std::to_string(g.timeout_s) + " s to resume its state",
              -1);
      }
    }
  }
  if (result.ok() && g.state == Group::State::kBroken)
    result = Precondition(name + " is broken: " + g.broken_reason);
  if (!result.ok()) {
    lock.unlock();
    std::lock_guard<std::mutex> glock(mu_);
    auto it = groups_.find({g.uid, g.key});
    if (it != groups_.end() && it->second == gp) groups_.erase(it);
    return result;
  }
  // Every rank hears the same state, with its own gradient slots.
  out->set_waited_s(g.waited_s);
  out->set_completed_step(g.step.completed_step);
  out->set_completed_grad_norm(g.step.completed_grad_norm);
  out->set_completed_status(g.step.completed_status);
  out->set_completed_params_updated(g.step.completed_params_updated);
  out->set_restored_subchunks(g.reg.report.restored_subchunks);
  out->set_rolled_forward(g.reg.report.rolled_forward);
  FillSlots(g.reg, m.local_rank(), out->add_registrations());
  return Status::Ok();
}

void GroupRegistry::Break(Group& g, const std::string& why, int leaver) {
  if (g.state == Group::State::kBroken) return;
  g.state = Group::State::kBroken;
  g.broken_reason = why;
  spdlog::warn("group '{}' broken: {}", g.key, why);
  if (g.plane != 0) planes_->StopPlane(g.plane, why, leaver);  // before any member's memory goes
  g.plane = 0;
  DropRegistration(*memory_, g.reg);
  g.cv.notify_all();
}

void GroupRegistry::Leave(uint64_t session_id, const std::string& reason) {
  std::shared_ptr<Group> gp;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = by_session_.find(session_id);
    if (it == by_session_.end()) return;
    gp = std::move(it->second);
    by_session_.erase(it);
  }
  {
    std::lock_guard<std::mutex> lock(gp->mu);
    int32_t rank = -1;
    Group::Member* m = gp->FindSession(session_id, &rank);
    if (m != nullptr) {
      const pid_t pid = m->joiner.pid;
      Break(*gp,
            "local rank " + std::to_string(rank) + " (pid " + std::to_string(pid) +
                ") left: " + reason,
            rank);
      gp->members.erase(rank);
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  auto it = groups_.find({gp->uid, gp->key});
  if (it != groups_.end() && it->second == gp) groups_.erase(it);
}

std::string GroupRegistry::KeyOf(uint64_t session_id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = by_session_.find(session_id);
  return it == by_session_.end() ? "" : it->second->key;
}

void GroupRegistry::FillStatus(v1::StatusResponse* out) {
  for (const auto& g : AllGroups()) {
    std::lock_guard<std::mutex> lock(g->mu);
    auto* gs = out->add_groups();
    gs->set_key(g->key);
    gs->set_uid(g->uid);
    gs->set_local_world_size(g->membership.local_world_size());
    gs->set_members(static_cast<uint32_t>(g->members.size()));
    gs->set_node_rank(g->membership.node_rank());
    gs->set_nnodes(g->membership.nnodes());
    gs->set_world_size(g->membership.world_size());
    std::string state = g->state == Group::State::kForming    ? "forming"
                        : g->state == Group::State::kResuming ? "resuming"
                        : g->state == Group::State::kRunning  ? "running"
                                                              : "broken";
    if (g->plane != 0 && !planes_->failure(g->plane).empty()) state = "broken";
    gs->set_state(state);
    gs->set_params(g->have_spec ? static_cast<uint64_t>(g->spec.params_size())
                                : static_cast<uint64_t>(g->reg.view.params.size()));
    for (const ShmSegment* seg : {g->reg.state.get(), g->reg.staging.get()}) {
      if (seg == nullptr) continue;
      const bool is_state = seg == g->reg.state.get();
      if (is_state) {
        gs->set_state_bytes(seg->size());
      } else {
        gs->set_staging_bytes(seg->size());
      }
      auto* s = out->add_segments();
      s->set_name(seg->name());
      s->set_kind(static_cast<v1::SegmentKind>(seg->kind()));
      s->set_bytes(seg->size());
      s->set_session_id(0);
      s->set_label("group '" + g->key + "' " + (is_state ? "optimizer-state" : "staging"));
    }
  }
}

}  // namespace trainstream::daemon
