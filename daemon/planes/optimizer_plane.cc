// OptimizerPlane (optimizer_plane.h): one thread consumes every member's
// command ring; engine callbacks on the worker pool answer on the completion
// rings.
//
// Note [Completions never block a worker]. Engine callbacks run on the shared
// worker pool. If they waited for room on a member's completion ring, a client
// that stops polling would stall every other session's updates. So completions
// that don't fit go to a per-member overflow queue (in daemon memory), which the
// plane's thread moves into the ring as the client drains it. Once the overflow
// is non-empty every completion goes through it, so order is kept. The queue is
// bounded (kMaxQueuedCompletions): a client that stops draining past it is
// ended (client_rings.h), so it cannot grow the daemon's memory.
//
// Note [How the plane waits]. One thread serves every member's command ring
// (one for a solo session, up to 64 for a group). It drains the rings in turn
// (at most kCommandsPerTurn commands each, so one rank cannot starve the
// rest); when all are empty it keeps looking for kSpinLooks ring looks in all,
// however many rings (during backward commands arrive back to back), then
// sleeps in one futex_waitv on every ring's wake word at once (the client
// wakes sleepers on each push; Stop wakes them too), for at most kSliceNs, or
// kShortSliceNs while completions wait in an overflow queue (a client
// draining its completion ring does not wake the plane). Where futex_waitv
// cannot be used (before Linux 5.16, or refused by a seccomp filter) it sleeps
// on one ring at a time, taking them in turn: kSliceNs for a solo session,
// else kShortSliceNs, then kLongSliceNs once the group has been idle for about
// 0.1 s, so a command on another ring waits at most that long.
//
// Chosen by measurement (trainstream-bench-plane-wait, benchmarks/plane_wait;
// cpu-2026-12-01-plane-wait.log: a 2-core machine shared with other builds, load
// 1 to 9, so medians over 5 to 7 runs, and still noisy) against the two loops
// this plane replaces: the solo plane's futex pop with 20 ms slices and the
// group plane's yields, then 50/500 us sleeps. Round trip of a SYNC:
//                          back to back   after 1 ms idle   after 20 ms   idle CPU
//   futex, 20 ms slice     6 us           9-15 us           14-22 us      0.13-0.17 %
//   yield/sleep back-off   0.4-5.5 us     5.4-9 us          6-16 us       2.2-2.7 %
//   this plane, 1 ring     4.7-5.7 us     6.7-40 us         22-53 us      0.11-0.15 %
//   this plane, 2 rings    0.2-5.6 us     6.8-41 us         41-82 us      0.12-0.14 %
// (one ring at a time for 2 rings, the fallback: 5 us, 14 us, 23 us, 2.6 %).
// The two old loops only echo; the plane's figures also hold the engine's
// SYNC and, after an idle gap, often a futex wake of the client itself (the
// answer comes after the client's spin). The back-off answers an idle plane a
// few microseconds sooner because it never sleeps for long: 20 times the idle
// CPU of a futex wait, per session or group, for ever. A wake after idleness
// costs tens of microseconds once per idle period (a forward pass,
// evaluation), against steps of hundreds of milliseconds; back to back the
// plane does not sleep, and the figures match. So the plane sleeps in the
// kernel, on every ring.
#include "planes/optimizer_plane.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <shared_mutex>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "logging/log_limiter.h"
#include "planes/grad_pool.h"
#include "planes/plane_common.h"
#include "trainstream/kernels/adamw.h"
#include "trainstream/optimizer/adamw_engine.h"
#include "trainstream/optimizer/worker_pool.h"
#include "trainstream/wire/grad_pool.h"
#include "trainstream/wire/session_control.h"

namespace trainstream::daemon {
namespace {

using wire::CommandRecord;
using wire::CompletionRecord;
using wire::CompletionStatus;
using wire::Opcode;
using wire::StateField;

// See Note [How the plane waits].
constexpr size_t kCommandsPerTurn = 64;
constexpr int kSpinLooks = 2000;  // empty rings looked at before sleeping
constexpr int64_t kSliceNs = 20'000'000;
constexpr int64_t kShortSliceNs = 50'000;
constexpr int64_t kLongSliceNs = 500'000;
constexpr int kWaitsBeforeLong = 2000;  // ~0.1 s of short slices
// SYNCs one member may have held before the group's first weights (Note [A
// member waits for the first weights]); the client posts one.
constexpr long kMaxHeldSyncsPerMember = 64;

bool SameHyper(const kernels::AdamWHyperParams& a, const kernels::AdamWHyperParams& b) {
  return a.lr == b.lr && a.beta1 == b.beta1 && a.beta2 == b.beta2 && a.eps == b.eps &&
         a.weight_decay == b.weight_decay;
}

kernels::AdamWHyperParams HyperOf(const CommandRecord& cmd) {
  return kernels::AdamWHyperParams{cmd.lr, cmd.beta1, cmd.beta2, cmd.eps, cmd.weight_decay};
}

}  // namespace

struct OptimizerPlane::Impl {
  // One member's ends of its rings.
  struct Member {
    explicit Member(PlaneMember m)
        : info(std::move(m)),
          commands(info.rings.command_ring(), info.rings.capacity),
          completions(info.rings.completion_ring(), info.rings.capacity) {}
    const PlaneMember info;
    CommandConsumer commands;     // consumed by `thread` only
    CompletionQueue completions;  // Guarded by completion_mu.
    bool faulted = false;         // Guarded by completion_mu: broke the wire rules
  };

  // One parameter's arrivals (group planes). Touched by the plane thread only.
  struct Slot {
    ParamBinding binding;
    kernels::DType grad_dtype = kernels::DType::kFloat32;
    uint64_t step = 0;          // step of the gradients arriving now
    uint64_t arrived_mask = 0;  // local ranks whose gradient of `step` has arrived
    uint32_t arrived = 0;
    kernels::AdamWHyperParams hp{};
    bool awaiting_reduce = false;  // REDUCE_READY posted, GRAD_REDUCED not yet
    // Note [A group takes written weights with its next gradient]: a kWeights held
    // until this parameter's next summed gradient (`weights` empty with
    // weights_in_place: the slot itself was written).
    bool weights_pending = false;
    bool weights_in_place = false;
    std::vector<unsigned char> weights;
  };

  Impl(PlaneOptions o, std::vector<PlaneMember> m, optimizer::WorkerPool* p)
      : options(std::move(o)), pool(p) {
    members.reserve(m.size());
    for (auto& mem : m) members.push_back(std::make_unique<Member>(std::move(mem)));
    live_members = members.size();
    thread = std::thread([this] { Run(); });
  }

  // ---------------------------------------------------------------- loop
  // See Note [How the plane waits].
  void Run() {
    int spins = 0, waits = 0;
    size_t watch = 0;
    CommandRecord cmd{};
    while (!stop.load(std::memory_order_acquire) &&
           live_members.load(std::memory_order_acquire) != 0) {
      bool any = false, backlog = false;
      for (size_t r = 0; r < members.size(); ++r) {
        Member& mem = *members[r];
        backlog |= FlushOverflow(r);
        for (size_t n = 0; n < kCommandsPerTurn; ++n) {
          const RingResult got = mem.commands.TryPop(&cmd);
          if (got == RingResult::kCorrupt) {
            std::lock_guard<std::mutex> lock(completion_mu);
            MemberFault(r, mem.commands.error());
          }
          if (got != RingResult::kOk) break;
          ApplyPending();
          Handle(static_cast<int>(r), cmd);
          any = true;
        }
      }
      if (any) {
        spins = waits = 0;
        continue;
      }
      if (spins < kSpinLooks) {
        spins += static_cast<int>(members.size());  // as long for 64 rings as for one
        continue;
      }
      // The client drains its completion ring without waking us: while
      // completions wait for room, look again soon.
      const int64_t slice = backlog ? kShortSliceNs : kSliceNs;
      CommandConsumer* rings[kMaxWaitRings];
      size_t n = 0;
      for (auto& mem : members) {
        if (n < kMaxWaitRings && mem->commands.error().empty()) rings[n++] = &mem->commands;
      }
      if (WaitForAnyRecord(rings, n, slice)) continue;
      // No futex_waitv: one ring at a time, the others looked at every slice.
      int64_t one = slice;
      if (members.size() > 1 && !backlog) {
        if (waits <= kWaitsBeforeLong) ++waits;  // capped: no overflow
        one = waits > kWaitsBeforeLong ? kLongSliceNs : kShortSliceNs;
      }
      members[watch]->commands.Wait(one);
      watch = (watch + 1) % members.size();
    }
  }

  void Handle(int r, const CommandRecord& cmd) {
    if (failed()) {
      // Answer what a client waits on, so no rank blocks on a group that failed.
      if (cmd.opcode == Opcode::kStepEnd || cmd.opcode == Opcode::kSync ||
          cmd.opcode == Opcode::kLoadState || cmd.opcode == Opcode::kExportState) {
        Post(r, Opcode::kGroupBroken, CompletionStatus::kInvalid, cmd.seq, cmd.param_id, cmd.step,
             failure());
      }
      return;
    }
    if (!engine) {
      Reject(r, cmd.seq, cmd.param_id, cmd.step, "no parameters are registered in this session");
      return;
    }
    switch (cmd.opcode) {
      case Opcode::kGradReady:
        OnGrad(r, cmd);
        return;
      case Opcode::kGradReduced:
        if (!options.group) break;  // unknown to a solo plane
        OnReduced(r, cmd);
        return;
      case Opcode::kStepEnd:
        OnStepEnd(r, cmd);
        return;
      case Opcode::kLoadState:
      case Opcode::kExportState:
        HandleState(r, cmd);
        return;
      case Opcode::kSync:
        if (options.group && r != 0 && !initialised) {
          // Note [A member waits for the first weights]; a client waits for its
          // one SYNC, so a member that keeps posting them is ended, not queued.
          const auto held = std::count_if(held_syncs.begin(), held_syncs.end(),
                                          [r](const auto& h) { return h.first == r; });
          if (held >= kMaxHeldSyncsPerMember) {
            std::lock_guard<std::mutex> lock(completion_mu);
            MemberFault(static_cast<size_t>(r),
                        "more than " + std::to_string(kMaxHeldSyncsPerMember) +
                            " SYNCs posted before the group's first weights");
            return;
          }
          held_syncs.emplace_back(r, cmd.seq);
          return;
        }
        engine->WaitIdle();
        Post(r, Opcode::kSyncDone, CompletionStatus::kOk, cmd.seq, 0, 0, "");
        return;
      default:
        break;
    }
    Reject(r, cmd.seq, cmd.param_id, cmd.step,
           "unknown command opcode " + std::to_string(static_cast<uint32_t>(cmd.opcode)));
  }

  // ------------------------------------------------------------ parameters
  Status AddParameters(const SessionOptimizerOptions& o, std::vector<ParamBinding> params,
                       bool adopted, std::vector<CarriedNorm> carried,
                       std::unique_ptr<GradientPool> pool) {
    std::lock_guard<std::mutex> lock(pending_mu);
    if (pool != nullptr && options.group)
      return Status(StatusCode::kInvalidArgument, "a data-parallel group has no gradient pool");
    if (have_options) {
      if (o.moment_dtype != engine_options.moment_dtype ||
          o.max_grad_norm != engine_options.max_grad_norm || o.seed != engine_options.seed) {
        return Status(StatusCode::kInvalidArgument,
                      "moment_dtype, max_grad_norm and seed must be the same in every "
                      "RegisterParameters call of a session");
      }
    } else {
      engine_options = o;
      have_options = true;
    }
    for (auto& p : params) pending.push_back({std::move(p), adopted});
    for (auto& c : carried) pending_carried.push_back(c);
    if (pool != nullptr) pools.push_back(std::move(pool));
    return Status::Ok();
  }

  // Plane thread: creates the engine with the first options, adds what came.
  void ApplyPending() {
    std::vector<PendingParam> adds;
    std::vector<CarriedNorm> carried;
    {
      std::lock_guard<std::mutex> lock(pending_mu);
      adds.swap(pending);
      carried.swap(pending_carried);
      if (!engine && have_options) CreateEngine();
    }
    bool fresh = false, adopted = false;
    for (auto& [b, was_adopted] : adds) {
      optimizer::ParamBinding eb;
      eb.param_id = b.param_id;
      eb.numel = b.numel;
      eb.param_dtype = b.param_dtype;
      eb.master = b.master;
      eb.master_lo = b.master_lo;
      eb.exp_avg = b.exp_avg;
      eb.exp_avg_sq = b.exp_avg_sq;
      eb.param_slot = b.param_slot;
      eb.durable = b.durable;
      if (options.group) {
        eb.grad_dtype = kernels::DType::kFloat32;  // the engine reads the fp32 sum slot
        eb.grad_slot = b.sum_slot;
      } else {
        eb.grad_dtype = b.grad_dtype;  // the client's slot (or pool extent), read in place
        eb.grad_slot = b.grad_slot;
        eb.grad_per_submit = b.pool != nullptr;
      }
      if (Status st = engine->AddParam(eb); !st.ok()) {
        Refuse(0, 0, b.param_id, 0, "param " + std::to_string(b.param_id) + ": " + st.message());
        continue;
      }
      (was_adopted ? adopted : fresh) = true;
      if (b.pool != nullptr) {
        std::unique_lock<std::shared_mutex> lock(pooled_mu);
        pooled[b.param_id] = PooledParam{b.pool, b.numel * wire::DTypeSize(b.grad_dtype)};
      }
      if (options.group) {
        auto slot = std::make_unique<Slot>();
        slot->grad_dtype = b.grad_dtype;
        slot->binding = std::move(b);
        by_id[slot->binding.param_id] = slot.get();
        slots.push_back(std::move(slot));
      }
    }
    // An engine's Init covers every parameter added since the last: adopted
    // state is taken as it is, fresh parameters wait for kParamFromSlot.
    if (adopted) {
      engine->AdoptInitialized();
      initialised = true;
    }
    for (const CarriedNorm& c : carried) {
      if (Status st = engine->CarryNorm(c.step, c.param_id, c.sumsq, c.updated); !st.ok())
        spdlog::warn("{}: carrying the norm of param {} into step {}: {}", options.name, c.param_id,
                     c.step, st.message());
    }
    if (fresh) needs_init = true;
  }

  void CreateEngine() {  // pending_mu held
    optimizer::EngineOptions eo;
    eo.moment_dtype = engine_options.moment_dtype;
    eo.max_grad_norm = engine_options.max_grad_norm;
    eo.seed = engine_options.seed;
    eo.chunk_elems = kPlaneChunkElems;
    unsigned workers = pool->size();
    if (engine_options.threads != 0 && engine_options.threads < pool->size()) {
      // Spread limited planes over the pool instead of stacking them all on
      // workers 0..threads-1.
      static std::atomic<unsigned> next_first{0};
      eo.workers = engine_options.threads;
      eo.first_worker = next_first.fetch_add(engine_options.threads) % pool->size();
      workers = engine_options.threads;
    }
    engine = std::make_unique<optimizer::AdamWEngine>(pool, eo);
    engine->SetCallbacks(
        [this](uint64_t id, uint64_t step, bool updated, uint64_t param_step) {
          OnParamDone(id, step, updated, param_step);
        },
        [this](const optimizer::StepResult& r) { OnStepDone(r); });
    engine_workers.store(workers, std::memory_order_release);
  }

  // ------------------------------------------------------------ gradients
  void OnGrad(int r, const CommandRecord& cmd) {
    if (!options.group) {
      // A group of one whose slot (or pool extent) the engine reads: nothing to
      // gather or sum.
      const PooledParam pp = PooledOf(cmd.param_id);
      const bool names_extent = (cmd.flags & wire::kFlagPooledGrad) != 0;
      if (names_extent != (pp.pool != nullptr) && engine->ParamNumel(cmd.param_id) != 0) {
        return Reject(r, cmd.seq, cmd.param_id, cmd.step,
                      "param " + std::to_string(cmd.param_id) +
                          (pp.pool != nullptr ? " streams through a gradient pool: GRAD_READY "
                                                "must name its extent"
                                              : " has a gradient slot, not a pool extent"));
      }
      optimizer::GradRef ref;
      if (pp.pool != nullptr) {
        // Note [A pool extent a client names] (grad_pool.h).
        if (Status st = pp.pool->Accept(cmd.param_id, cmd.region_offset, cmd.bytes, pp.bytes, &ref);
            !st.ok())
          return Reject(r, cmd.seq, cmd.param_id, cmd.step, st.message());
      }
      Status st =
          engine->SubmitGrad(cmd.param_id, cmd.step, HyperOf(cmd), pp.pool ? &ref : nullptr);
      if (!st.ok()) {
        if (pp.pool != nullptr) pp.pool->Release(cmd.param_id);  // no update reads it
        Refuse(r, cmd.seq, cmd.param_id, cmd.step, st.message());
      }
      return;
    }
    auto it = by_id.find(cmd.param_id);
    if (it == by_id.end()) {
      Reject(r, cmd.seq, cmd.param_id, cmd.step,
             "unknown param_id " + std::to_string(cmd.param_id));
      return;
    }
    Slot& s = *it->second;
    const kernels::AdamWHyperParams hp = HyperOf(cmd);
    const std::string name = "'" + s.binding.name + "'";
    if (s.awaiting_reduce) {
      return Fail("local rank " + std::to_string(r) + " posted " + name + " for step " +
                  std::to_string(cmd.step) + " before step " + std::to_string(s.step) +
                  " was all-reduced");
    }
    if (s.arrived == 0) {
      s.step = cmd.step;
      s.hp = hp;
    } else if (cmd.step != s.step) {
      return Fail("local rank " + std::to_string(r) + " posted " + name + " for step " +
                  std::to_string(cmd.step) + ", other ranks for step " + std::to_string(s.step));
    } else if (!SameHyper(hp, s.hp)) {
      return Fail("local rank " + std::to_string(r) + " posted " + name +
                  " with other hyper-parameters (lr, betas, eps, weight_decay) than the rest");
    }
    const uint64_t bit = 1ull << r;
    if (s.arrived_mask & bit) {
      return Fail("local rank " + std::to_string(r) + " posted " + name + " twice in step " +
                  std::to_string(cmd.step));
    }
    s.arrived_mask |= bit;
    if (++s.arrived < members.size()) return;
    s.arrived = 0;
    s.arrived_mask = 0;
    Sum(s);
    if (options.cross_node) {
      s.awaiting_reduce = true;
      ++awaiting_reduces;
      Post(0, Opcode::kReduceReady, CompletionStatus::kOk, 0, cmd.param_id, s.step, "");
      return;
    }
    Submit(s);
  }

  void OnReduced(int r, const CommandRecord& cmd) {
    auto it = by_id.find(cmd.param_id);
    if (r != 0 || !options.cross_node || it == by_id.end() || !it->second->awaiting_reduce ||
        it->second->step != cmd.step) {
      return Fail("local rank " + std::to_string(r) + " posted GRAD_REDUCED for param " +
                  std::to_string(cmd.param_id) + " step " + std::to_string(cmd.step) +
                  ", which was not waiting for a reduction");
    }
    it->second->awaiting_reduce = false;
    --awaiting_reduces;
    Submit(*it->second);
  }

  void Sum(Slot& s) {
    SumRankGradients(s.binding.rank_grads, s.grad_dtype, s.binding.sum_slot, s.binding.numel,
                     static_cast<float>(options.world_size), pool);
  }

  void Submit(Slot& s) {
    if (s.weights_pending) {
      s.weights_pending = false;
      Status st = engine->AdoptWeights(
          s.binding.param_id, s.weights_in_place ? nullptr : s.weights.data(), s.weights.size());
      std::vector<unsigned char>().swap(s.weights);
      if (!st.ok()) return Fail(st.message());
    }
    Status st = engine->SubmitGrad(s.binding.param_id, s.step, s.hp);
    if (!st.ok()) Fail(st.message());
  }

  // Note [A group takes written weights with its next gradient]
  // A group's param slots are shared by its members, and each member copies its new
  // weights from them after the step's PARAM_READY, when it gets to it. Local rank
  // 0 hands weights written after wrap() over (kWeights, Note [Weights written from
  // outside the engine]) before its first gradient of the next step, which can be
  // before a slower member has copied the last step's weights: applied then, the
  // slot would change under that copy (the member took the written weights for the
  // update's and wrote them again: a halving applied twice, seen under load). So a
  // group keeps the weights (a copy in daemon memory, at most one per parameter,
  // replaced by a later one) and applies them just before the parameter's next
  // summed gradient is submitted: every member has posted its gradient of that step
  // then, after copying the last step's weights, and has no read of the slot left
  // before the update. A master loaded in between (kMaster) drops them.
  Status HoldWeights(const CommandRecord& cmd, const RegionResolver& resolver) {
    auto it = by_id.find(cmd.param_id);
    if (it == by_id.end())
      return Status(StatusCode::kNotFound, "unknown param_id " + std::to_string(cmd.param_id));
    Slot& s = *it->second;
    const uint64_t bytes = s.binding.numel * wire::DTypeSize(s.binding.param_dtype);
    if (cmd.bytes != 0 && cmd.bytes != bytes) {
      return Status(StatusCode::kInvalidArgument,
                    "weights of parameter " + std::to_string(cmd.param_id) + " are " +
                        std::to_string(cmd.bytes) + " bytes; it needs " + std::to_string(bytes) +
                        " (or 0: its slot holds them)");
    }
    std::vector<unsigned char> copy;
    if (cmd.bytes != 0) {
      const void* payload = resolver(cmd.region_id, cmd.region_offset, cmd.bytes);
      if (payload == nullptr) {
        return Status(StatusCode::kInvalidArgument, "region " + std::to_string(cmd.region_id) +
                                                        " [" + std::to_string(cmd.region_offset) +
                                                        ", +" + std::to_string(cmd.bytes) +
                                                        ") is not a region of this session");
      }
      copy.assign(static_cast<const unsigned char*>(payload),
                  static_cast<const unsigned char*>(payload) + cmd.bytes);
    }
    s.weights_pending = true;
    s.weights_in_place = cmd.bytes == 0;
    s.weights.swap(copy);
    return Status::Ok();
  }

  void OnStepEnd(int r, const CommandRecord& cmd) {
    if (options.group && !AllEnded(r, cmd)) return;
    Status st = engine->StepEnd(cmd.step);
    if (!st.ok()) Refuse(r, cmd.seq, 0, cmd.step, st.message());
  }

  // Group planes: records local rank r's STEP_END; true once every rank has
  // posted it and the step is whole (else false, the group failed if it is not).
  bool AllEnded(int r, const CommandRecord& cmd) {
    uint64_t& mask = step_ends[cmd.step];
    const uint64_t bit = 1ull << r;
    if (mask & bit) {
      Fail("local rank " + std::to_string(r) + " ended step " + std::to_string(cmd.step) +
           " twice");
      return false;
    }
    mask |= bit;
    if (mask != (members.size() == 64 ? ~0ull : (1ull << members.size()) - 1)) return false;
    step_ends.erase(cmd.step);
    // Every rank's STEP_END follows its own GRAD_READYs (and local rank 0's
    // GRAD_REDUCEDs) on its ring, so anything still half-arrived now means
    // the ranks produced gradients for different parameters.
    for (const auto& s : slots) {
      if (s->arrived != 0 && s->step == cmd.step) {
        std::string have, missing;
        for (size_t i = 0; i < members.size(); ++i) {
          std::string& list = ((s->arrived_mask >> i) & 1) != 0 ? have : missing;
          list += (list.empty() ? "" : ",") + std::to_string(i);
        }
        Fail("step " + std::to_string(cmd.step) + ": '" + s->binding.name +
             "' has a gradient from local rank " + have + " but not " + missing +
             " (ranks must train the same parameters)");
        return false;
      }
    }
    if (awaiting_reduces != 0) {
      Fail("local rank 0 ended step " + std::to_string(cmd.step) +
           " before all-reducing every machine sum");
      return false;
    }
    return true;
  }

  // ---------------------------------------------------------------- state
  // State moves run between steps: the engine is idle first, so no update races them.
  void HandleState(int r, const CommandRecord& cmd) {
    const bool load = cmd.opcode == Opcode::kLoadState;
    engine->WaitIdle();
    CompletionRecord rec{};
    rec.opcode = Opcode::kStateDone;
    rec.seq = cmd.seq;
    rec.param_id = cmd.param_id;
    Status st;
    if (cmd.field == StateField::kParamFromSlot) {
      if (!load) {
        st = Status(StatusCode::kInvalidArgument, "kParamFromSlot can only be loaded");
      } else if (engine->ParamNumel(cmd.param_id) == 0) {
        st = Status(StatusCode::kNotFound, "unknown param_id " + std::to_string(cmd.param_id));
      } else if (r == 0 && needs_init) {
        // Init covers every parameter added since the last Init, so local rank
        // 0 (a group's initial weights; a solo session's only member) writes
        // all slots first and then posts these; only the first one works.
        needs_init = false;
        st = engine->Init();
        ReleaseHeldSyncs();
      }
    } else if (options.group && load && cmd.field == StateField::kWeights) {
      st = HoldWeights(cmd, members[static_cast<size_t>(r)]->info.resolver);
    } else {
      bool imported = false;
      uint64_t imported_step = 0;
      st = MoveOptimizerState(*engine, cmd, members[static_cast<size_t>(r)]->info.resolver,
                              &rec.step, &imported, &imported_step);
      if (auto it = by_id.find(cmd.param_id);
          st.ok() && load && cmd.field == StateField::kMaster && it != by_id.end()) {
        it->second->weights_pending = false;  // the loaded master supersedes them
        std::vector<unsigned char>().swap(it->second->weights);
      }
    }
    if (!st.ok()) {
      rec.status = CompletionStatus::kInvalid;
      SetCompletionMessage(&rec, st.message());
    }
    Complete(static_cast<size_t>(r), rec);
  }

  // Note [A member waits for the first weights]. A group's param slots are
  // shared by its members, and local rank 0 alone writes the initial weights
  // into them (then posts kParamFromSlot, whose first one initialises the
  // masters from the slots). The other members use those slots as soon as
  // their registration ends: a paged weight's home is its param slot
  // (streaming/weights.py), so a member whose first forward ran before local
  // rank 0 had written the slots trained on what the new segment held (zeros)
  // and, through the group's sums, every rank's update went wrong (a failure
  // seen only under load: test_dp.py's paged case). So the SYNC that ends a
  // registration (DaemonBackend.register) is answered to every member but
  // local rank 0 only once local rank 0's slots are written, the masters
  // initialised from them: until then it is held here (a group that fails
  // first answers it with GROUP_BROKEN, as every member gets then).
  void ReleaseHeldSyncs() {
    initialised = true;
    for (const auto& [r, seq] : held_syncs)
      Post(r, Opcode::kSyncDone, CompletionStatus::kOk, seq, 0, 0, "");
    held_syncs.clear();
  }

  // ------------------------------------------------- engine callbacks (workers)
  // The engine has committed the update (Note [Optimizer state outlives the daemon]).
  void OnParamDone(uint64_t id, uint64_t step, bool updated, uint64_t /*param_step*/) {
    // The extent is free once the update committed, before the client hears of it.
    if (GradientPool* pool = PooledOf(id).pool; pool != nullptr) pool->Release(id);
    for (size_t r = 0; r < members.size(); ++r) {
      Post(static_cast<int>(r), Opcode::kParamReady,
           updated ? CompletionStatus::kOk : CompletionStatus::kSkippedNonFinite, 0, id, step, "");
    }
  }

  void OnStepDone(const optimizer::StepResult& res) {
    CompletionRecord rec{};
    rec.opcode = Opcode::kStepDone;
    rec.status =
        res.skipped_nonfinite ? CompletionStatus::kSkippedNonFinite : CompletionStatus::kOk;
    rec.step = res.step;
    rec.grad_norm = res.grad_norm;
    rec.params_updated = res.params_updated;
    if (!res.error.ok()) SetCompletionMessage(&rec, res.error.message());
    for (size_t r = 0; r < members.size(); ++r) Complete(r, rec);
  }

  // ------------------------------------------------------------ completions
  void Post(int r, Opcode op, CompletionStatus status, uint64_t seq, uint64_t param_id,
            uint64_t step, const std::string& message) {
    CompletionRecord rec{};
    rec.opcode = op;
    rec.status = status;
    rec.seq = seq;
    rec.param_id = param_id;
    rec.step = step;
    if (!message.empty()) SetCompletionMessage(&rec, message);
    Complete(static_cast<size_t>(r), rec);
  }

  // A command of member r that cannot be applied: answered with ERROR.
  void Reject(int r, uint64_t seq, uint64_t param_id, uint64_t step, const std::string& why) {
    if (uint64_t dropped = 0; log_limit.Allow(&dropped)) {
      spdlog::warn("{}: local rank {}: rejected command: {}{}", options.name, r, why,
                   dropped == 0 ? "" : " (" + std::to_string(dropped) + " more not logged)");
    }
    Post(r, Opcode::kError, CompletionStatus::kInvalid, seq, param_id, step, why);
  }

  // What the engine refused: an ERROR for that command in a solo session; a
  // group has one state for every rank, so it fails (optimizer_plane.h).
  void Refuse(int r, uint64_t seq, uint64_t param_id, uint64_t step, const std::string& why) {
    if (options.group) return Fail(why);
    Reject(r, seq, param_id, step, why);
  }

  // See Note [Completions never block a worker].
  // Dropped once the plane is stopping: what the engine finishes then is not a
  // result any member may take (see StopThread).
  void Complete(size_t r, const CompletionRecord& rec, bool even_when_stopping = false) {
    std::lock_guard<std::mutex> lock(completion_mu);
    Member& mem = *members[r];
    if ((muted && !even_when_stopping) || mem.faulted) return;
    if (Status st = mem.completions.Push(rec); !st.ok()) MemberFault(r, st.message());
  }

  // Returns whether completions still wait for room.
  bool FlushOverflow(size_t r) {
    std::lock_guard<std::mutex> lock(completion_mu);
    Member& mem = *members[r];
    if (mem.faulted) return false;
    if (Status st = mem.completions.Flush(); !st.ok()) MemberFault(r, st.message());
    return !mem.faulted && mem.completions.backlogged();
  }

  // Member r broke the wire rules (client_rings.h): its rings are not touched
  // again, its session is ended (which, in a group, breaks the group, as any
  // leaving rank does). completion_mu held.
  void MemberFault(size_t r, const std::string& why) {
    Member& mem = *members[r];
    if (mem.faulted) return;
    mem.faulted = true;
    mem.completions.Clear();
    live_members.fetch_sub(1, std::memory_order_acq_rel);
    spdlog::warn("{}: local rank {} (session {}): {}; ending its session", options.name, r,
                 mem.info.session_id, why);
    if (options.on_fault) options.on_fault(mem.info.session_id, why);
  }

  // The ranks disagreed: tell every member, answer later waits with the reason.
  void Fail(const std::string& why) {
    {
      std::lock_guard<std::mutex> lock(failure_mu);
      if (!failure_message.empty()) return;
      failure_message = why;
    }
    spdlog::warn("{}: {}", options.name, why);
    for (size_t r = 0; r < members.size(); ++r)
      Post(static_cast<int>(r), Opcode::kGroupBroken, CompletionStatus::kInvalid, 0, 0, 0, why);
  }

  bool failed() const {
    std::lock_guard<std::mutex> lock(failure_mu);
    return !failure_message.empty();
  }
  std::string failure() const {
    std::lock_guard<std::mutex> lock(failure_mu);
    return failure_message;
  }

  void StopThread() {
    stop.store(true, std::memory_order_release);
    for (auto& mem : members) mem->commands.Wake();
    if (thread.joinable()) thread.join();
    {
      std::lock_guard<std::mutex> lock(completion_mu);
      muted = true;
    }
    // The engine's destructor ends a step some member never ended (it died
    // mid-step), so the engine drains (a deferred step's updates wait for
    // StepEnd), and waits for in-flight updates; the plane's state is being
    // discarded, so what those updates write does not matter.
    engine.reset();
  }

  const PlaneOptions options;
  optimizer::WorkerPool* const pool;
  std::vector<std::unique_ptr<Member>> members;  // by local rank; fixed after construction
  std::atomic<size_t> live_members{0};           // members not faulted
  LogLimiter log_limit;

  struct PendingParam {
    ParamBinding binding;
    bool adopted = false;
  };
  // A parameter whose gradients stream through a pool, and its gradient's bytes.
  struct PooledParam {
    GradientPool* pool = nullptr;
    uint64_t bytes = 0;
  };
  PooledParam PooledOf(uint64_t param_id) const {
    std::shared_lock<std::shared_mutex> lock(pooled_mu);
    auto it = pooled.find(param_id);
    return it == pooled.end() ? PooledParam{} : it->second;
  }
  std::mutex pending_mu;  // guards pending, pending_carried, engine_options, have_options
  std::vector<PendingParam> pending;
  std::vector<CarriedNorm> pending_carried;
  // Guarded by pending_mu (appended); destroyed after the engine (StopThread).
  std::vector<std::unique_ptr<GradientPool>> pools;
  // Written by the plane thread as parameters are applied, read by workers.
  mutable std::shared_mutex pooled_mu;  // guards pooled
  std::unordered_map<uint64_t, PooledParam> pooled;
  SessionOptimizerOptions engine_options;
  bool have_options = false;

  // Plane thread only (the engine: created there, reset in StopThread after the join).
  std::unique_ptr<optimizer::AdamWEngine> engine;
  std::atomic<unsigned> engine_workers{0};
  bool needs_init = false;
  // Group planes: whether local rank 0 has initialised the masters from the slots,
  // and the other members' SYNCs held until then (member, seq): see
  // Note [A member waits for the first weights].
  bool initialised = false;
  std::vector<std::pair<int, uint64_t>> held_syncs;
  std::vector<std::unique_ptr<Slot>> slots;  // group planes
  std::unordered_map<uint64_t, Slot*> by_id;
  std::map<uint64_t, uint64_t> step_ends;  // step -> mask of ranks that posted STEP_END
  uint64_t awaiting_reduces = 0;

  std::mutex completion_mu;  // guards each member's completions and faulted, and muted
  bool muted = false;        // Guarded by completion_mu: set once stopping

  mutable std::mutex failure_mu;  // guards failure_message
  std::string failure_message;

  std::mutex stop_mu;    // guards stopped
  bool stopped = false;  // Guarded by stop_mu
  std::atomic<bool> stop{false};
  std::thread thread;  // last: started after every member above exists
};

OptimizerPlane::OptimizerPlane(PlaneOptions options, std::vector<PlaneMember> members,
                               optimizer::WorkerPool* pool)
    : impl_(std::make_unique<Impl>(std::move(options), std::move(members), pool)) {}

OptimizerPlane::~OptimizerPlane() { Stop("", -1); }

Status OptimizerPlane::AddParameters(const SessionOptimizerOptions& options,
                                     std::vector<ParamBinding> params, bool adopted,
                                     std::vector<CarriedNorm> carried,
                                     std::unique_ptr<GradientPool> pool) {
  return impl_->AddParameters(options, std::move(params), adopted, std::move(carried),
                              std::move(pool));
}

void OptimizerPlane::Stop(const std::string& why, int leaver) {
  {
    std::lock_guard<std::mutex> lock(impl_->stop_mu);
    if (impl_->stopped) return;
    impl_->stopped = true;
  }
  impl_->StopThread();
  if (why.empty()) return;
  for (size_t r = 0; r < impl_->members.size(); ++r) {
    if (static_cast<int>(r) == leaver) continue;
    CompletionRecord rec{};
    rec.opcode = Opcode::kGroupBroken;
    rec.status = CompletionStatus::kInvalid;
    SetCompletionMessage(&rec, why);
    impl_->FlushOverflow(r);
    impl_->Complete(r, rec, /*even_when_stopping=*/true);
  }
}

std::string OptimizerPlane::failure() const { return impl_->failure(); }

unsigned OptimizerPlane::engine_workers() const {
  return impl_->engine_workers.load(std::memory_order_acquire);
}

}  // namespace trainstream::daemon
