// GroupPlane (group_plane.h): one thread polls every member's command ring.
//
// Note [Polling several rings]. A futex waits on one word, and each member's
// ring has its own, so the group thread cannot sleep on all of them at once.
// It drains every ring in turn and, when all are empty, backs off: a few
// yields, then sleeps of kIdleSleepUs, and kLongIdleSleepUs once the group has
// been idle for a while (a forward pass, evaluation, checkpointing). A command
// arriving at an idle group is noticed within that sleep; during backward
// commands arrive back to back and are taken without sleeping.
#include "planes/group_plane.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "planes/plane_common.h"
#include "trainstream/kernels/adamw.h"
#include "trainstream/optimizer/adamw_engine.h"
#include "trainstream/optimizer/worker_pool.h"
#include "trainstream/wire/session_control.h"

namespace trainstream::daemon {
namespace {

using wire::CommandRecord;
using wire::CompletionRecord;
using wire::CompletionStatus;
using wire::Opcode;
using wire::StateField;

constexpr int kIdleYields = 200;
constexpr int kIdleSleepUs = 50;             // see Note [Polling several rings]
constexpr int kIdleSleepsBeforeLong = 2000;  // ~0.1 s of short sleeps
constexpr int kLongIdleSleepUs = 500;
constexpr size_t kCommandsPerTurn = 64;        // per ring, so one rank cannot starve the rest
constexpr size_t kSumBlockElems = 4096;        // summed block by block, in cache
constexpr size_t kParallelSumElems = 1 << 18;  // larger sums are split over the worker pool

// dst[i] = (sum over r of srcs[r][i]) / divisor for i in [begin, end).
void SumBlock(const std::vector<void*>& srcs, kernels::DType dtype, float* dst, size_t begin,
              size_t end, float divisor) {
  float tmp[kSumBlockElems];
  const size_t es = kernels::DTypeSize(dtype);
  for (size_t b = begin; b < end; b += kSumBlockElems) {
    const size_t n = std::min(kSumBlockElems, end - b);
    float* out = dst + b;
    kernels::ConvertToFloat(static_cast<const char*>(srcs[0]) + b * es, dtype, out, n);
    for (size_t r = 1; r < srcs.size(); ++r) {
      const float* in = tmp;
      if (dtype == kernels::DType::kFloat32) {
        in = static_cast<const float*>(srcs[r]) + b;
      } else {
        kernels::ConvertToFloat(static_cast<const char*>(srcs[r]) + b * es, dtype, tmp, n);
      }
      for (size_t i = 0; i < n; ++i) out[i] += in[i];
    }
    if (divisor != 1.0f) {
      for (size_t i = 0; i < n; ++i) out[i] /= divisor;
    }
  }
}

bool SameHyper(const kernels::AdamWHyperParams& a, const kernels::AdamWHyperParams& b) {
  return a.lr == b.lr && a.beta1 == b.beta1 && a.beta2 == b.beta2 && a.eps == b.eps &&
         a.weight_decay == b.weight_decay;
}

}  // namespace

struct GroupPlane::Impl {
  // One parameter's arrivals. Touched by the group thread only.
  struct Slot {
    GroupParamBinding binding;
    kernels::DType grad_dtype = kernels::DType::kFloat32;
    uint64_t step = 0;          // step of the gradients arriving now
    uint64_t arrived_mask = 0;  // local ranks whose gradient of `step` has arrived
    uint32_t arrived = 0;
    kernels::AdamWHyperParams hp{};
    bool awaiting_reduce = false;  // REDUCE_READY posted, GRAD_REDUCED not yet
  };

  Impl(GroupPlaneOptions o, std::vector<GroupMemberRings> m, std::vector<GroupParamBinding> params,
       optimizer::WorkerPool* p)
      : options(std::move(o)), members(std::move(m)), pool(p) {
    for (auto& mem : members) {
      commands.emplace_back(mem.rings.command_ring(), mem.rings.capacity);
      completions.emplace_back(mem.rings.completion_ring(), mem.rings.capacity);
    }
    faulted.resize(members.size(), false);
    optimizer::EngineOptions eo;
    eo.moment_dtype = options.optimizer.moment_dtype;
    eo.max_grad_norm = options.optimizer.max_grad_norm;
    eo.seed = options.optimizer.seed;
    engine = std::make_unique<optimizer::AdamWEngine>(pool, eo);
    engine->SetCallbacks(
        [this](uint64_t id, uint64_t step, bool updated, uint64_t param_step) {
          OnParamDone(id, step, updated, param_step);
        },
        [this](const optimizer::StepResult& r) { OnStepDone(r); });
    for (auto& b : params) {
      optimizer::ParamBinding eb;
      eb.param_id = b.param.param_id;
      eb.numel = b.param.numel;
      eb.param_dtype = b.param.param_dtype;
      eb.grad_dtype = kernels::DType::kFloat32;  // the engine reads the fp32 sum slot
      eb.master = b.param.master;
      eb.exp_avg = b.param.exp_avg;
      eb.exp_avg_sq = b.param.exp_avg_sq;
      eb.grad_slot = b.sum_slot;
      eb.param_slot = b.param.param_slot;
      Status st = engine->AddParam(eb);
      if (!st.ok()) Fail("param " + std::to_string(b.param.param_id) + ": " + st.message());
      step_counters[b.param.param_id] = b.param.step_counter;
      auto slot = std::make_unique<Slot>();
      slot->grad_dtype = b.param.grad_dtype;
      slot->binding = std::move(b);
      by_id[slot->binding.param.param_id] = slot.get();
      slots.push_back(std::move(slot));
    }
    thread = std::thread([this] { Run(); });
  }

  // ---------------------------------------------------------------- loop
  void Run() {
    int idle = 0;
    CommandRecord cmd{};
    while (!stop.load(std::memory_order_acquire)) {
      bool any = false;
      for (size_t r = 0; r < members.size(); ++r) {
        FlushOverflow(r);
        for (size_t n = 0; n < kCommandsPerTurn; ++n) {
          const RingResult got = commands[r].TryPop(&cmd);
          if (got == RingResult::kCorrupt) {
            std::lock_guard<std::mutex> lock(completion_mu);
            MemberFault(r, commands[r].error());
          }
          if (got != RingResult::kOk) break;
          Handle(static_cast<int>(r), cmd);
          any = true;
        }
      }
      if (any) {
        idle = 0;
        continue;
      }
      if (idle <= kIdleYields + kIdleSleepsBeforeLong) ++idle;  // capped: no overflow
      if (idle < kIdleYields) {
        std::this_thread::yield();
      } else {
        const bool long_idle = idle > kIdleYields + kIdleSleepsBeforeLong;
        std::this_thread::sleep_for(
            std::chrono::microseconds(long_idle ? kLongIdleSleepUs : kIdleSleepUs));
      }
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
    switch (cmd.opcode) {
      case Opcode::kGradReady:
        OnGrad(r, cmd);
        return;
      case Opcode::kGradReduced:
        OnReduced(r, cmd);
        return;
      case Opcode::kStepEnd:
        OnStepEnd(r, cmd);
        return;
      case Opcode::kLoadState:
      case Opcode::kExportState:
        HandleState(r, cmd);
        return;
      case Opcode::kSync: {
        engine->WaitIdle();
        Post(r, Opcode::kSyncDone, CompletionStatus::kOk, cmd.seq, 0, 0, "");
        return;
      }
      default:
        Post(r, Opcode::kError, CompletionStatus::kInvalid, cmd.seq, cmd.param_id, cmd.step,
             "unknown command opcode " + std::to_string(static_cast<uint32_t>(cmd.opcode)));
    }
  }

  // ------------------------------------------------------------ gradients
  void OnGrad(int r, const CommandRecord& cmd) {
    auto it = by_id.find(cmd.param_id);
    if (it == by_id.end()) {
      Post(r, Opcode::kError, CompletionStatus::kInvalid, cmd.seq, cmd.param_id, cmd.step,
           "unknown param_id " + std::to_string(cmd.param_id));
      return;
    }
    Slot& s = *it->second;
    const kernels::AdamWHyperParams hp{cmd.lr, cmd.beta1, cmd.beta2, cmd.eps, cmd.weight_decay};
    const std::string name = "'" + s.binding.param.name + "'";
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
    const size_t n = s.binding.param.numel;
    const auto divisor = static_cast<float>(options.world_size);
    if (n < kParallelSumElems || pool->size() < 2) {
      SumBlock(s.binding.rank_grads, s.grad_dtype, s.binding.sum_slot, 0, n, divisor);
      return;
    }
    const size_t parts = std::min<size_t>(pool->size(), n / (kParallelSumElems / 4));
    const size_t per = (n + parts - 1) / parts;
    std::mutex mu;
    std::condition_variable cv;
    size_t left = parts;
    for (size_t i = 0; i < parts; ++i) {
      const size_t begin = i * per, end = std::min(n, begin + per);
      pool->Submit(static_cast<unsigned>(i), [&, begin, end] {
        SumBlock(s.binding.rank_grads, s.grad_dtype, s.binding.sum_slot, begin, end, divisor);
        std::lock_guard<std::mutex> lock(mu);
        if (--left == 0) cv.notify_one();
      });
    }
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return left == 0; });
  }

  void Submit(Slot& s) {
    open_steps[s.step] += 1;
    Status st = engine->SubmitGrad(s.binding.param.param_id, s.step, s.hp);
    if (!st.ok()) Fail(st.message());
  }

  void OnStepEnd(int r, const CommandRecord& cmd) {
    uint64_t& mask = step_ends[cmd.step];
    const uint64_t bit = 1ull << r;
    if (mask & bit)
      return Fail("local rank " + std::to_string(r) + " ended step " + std::to_string(cmd.step) +
                  " twice");
    mask |= bit;
    if (mask != (members.size() == 64 ? ~0ull : (1ull << members.size()) - 1)) return;
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
        return Fail("step " + std::to_string(cmd.step) + ": '" + s->binding.param.name +
                    "' has a gradient from local rank " + have + " but not " + missing +
                    " (ranks must train the same parameters)");
      }
    }
    if (awaiting_reduces != 0) {
      return Fail("local rank 0 ended step " + std::to_string(cmd.step) +
                  " before all-reducing every machine sum");
    }
    open_steps.erase(cmd.step);
    Status st = engine->StepEnd(cmd.step);
    if (!st.ok()) Fail(st.message());
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
        // Local rank 0 wrote every param slot (the group's initial weights).
        needs_init = false;
        st = engine->Init();
      }
    } else {
      bool imported = false;
      uint64_t imported_step = 0;
      st = MoveOptimizerState(*engine, cmd, members[static_cast<size_t>(r)].resolver, &rec.step,
                              &imported, &imported_step);
      if (st.ok() && imported) SetStepCounter(cmd.param_id, imported_step);
    }
    if (!st.ok()) {
      rec.status = CompletionStatus::kInvalid;
      SetCompletionMessage(&rec, st.message());
    }
    Complete(static_cast<size_t>(r), rec);
  }

  // ------------------------------------------------- engine callbacks (workers)
  void OnParamDone(uint64_t id, uint64_t step, bool updated, uint64_t param_step) {
    if (updated) SetStepCounter(id, param_step);
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

  void SetStepCounter(uint64_t id, uint64_t step) {
    std::lock_guard<std::mutex> lock(step_mu);
    auto it = step_counters.find(id);
    if (it != step_counters.end() && it->second != nullptr) *it->second = step;
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

  // See Note [Completions never block a worker] (optimizer_service.cc).
  // Dropped once the plane is stopping: what the engine finishes then is not a
  // result any rank may take (see StopThread).
  void Complete(size_t r, const CompletionRecord& rec, bool even_when_stopping = false) {
    std::lock_guard<std::mutex> lock(completion_mu);
    if ((muted && !even_when_stopping) || faulted[r]) return;
    if (Status st = completions[r].Push(rec); !st.ok()) MemberFault(r, st.message());
  }

  void FlushOverflow(size_t r) {
    std::lock_guard<std::mutex> lock(completion_mu);
    if (faulted[r]) return;
    if (Status st = completions[r].Flush(); !st.ok()) MemberFault(r, st.message());
  }

  // Member r broke the wire rules (client_rings.h): its rings are not touched
  // again, its session is ended (which breaks the group, as any leaving rank
  // does). completion_mu held.
  void MemberFault(size_t r, const std::string& why) {
    if (faulted[r]) return;
    faulted[r] = true;
    completions[r].Clear();
    spdlog::warn("group '{}': local rank {}: {}; ending its session", options.name, r, why);
    if (options.on_fault) options.on_fault(members[r].session_id, why);
  }

  // The ranks disagreed: tell every member, answer later waits with the reason.
  void Fail(const std::string& why) {
    {
      std::lock_guard<std::mutex> lock(failure_mu);
      if (!failure_message.empty()) return;
      failure_message = why;
    }
    spdlog::warn("group '{}': {}", options.name, why);
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
    if (thread.joinable()) thread.join();
    {
      std::lock_guard<std::mutex> lock(completion_mu);
      muted = true;
    }
    // A step some rank never ended (it died mid-step) is ended here so the
    // engine drains (a deferred step's updates wait for StepEnd); the group's
    // state is being discarded, so what those updates write does not matter.
    for (auto& [step, count] : open_steps) engine->StepEnd(step);
    open_steps.clear();
    engine->WaitIdle();
  }

  const GroupPlaneOptions options;
  const std::vector<GroupMemberRings> members;
  optimizer::WorkerPool* const pool;
  std::vector<CommandConsumer> commands;     // consumed by `thread` only
  std::vector<CompletionQueue> completions;  // Guarded by completion_mu.

  // Group thread only.
  std::vector<std::unique_ptr<Slot>> slots;
  std::unordered_map<uint64_t, Slot*> by_id;
  std::map<uint64_t, uint64_t> step_ends;   // step -> mask of ranks that posted STEP_END
  std::map<uint64_t, uint64_t> open_steps;  // step -> submissions, until StepEnd
  uint64_t awaiting_reduces = 0;
  bool needs_init = true;

  std::unique_ptr<optimizer::AdamWEngine> engine;

  std::mutex step_mu;  // guards step_counters (the manifest's per-param step)
  std::unordered_map<uint64_t, uint64_t*> step_counters;

  std::mutex completion_mu;   // guards completions, faulted and muted
  std::vector<bool> faulted;  // Guarded by completion_mu: member r broke the wire rules
  bool muted = false;         // Guarded by completion_mu: set once stopping

  mutable std::mutex failure_mu;  // guards failure_message
  std::string failure_message;

  std::mutex stop_mu;    // guards stopped
  bool stopped = false;  // Guarded by stop_mu
  std::atomic<bool> stop{false};
  std::thread thread;  // last: started after every member above exists
};

GroupPlane::GroupPlane(GroupPlaneOptions options, std::vector<GroupMemberRings> members,
                       std::vector<GroupParamBinding> params, optimizer::WorkerPool* pool)
    : impl_(std::make_unique<Impl>(std::move(options), std::move(members), std::move(params),
                                   pool)) {}

GroupPlane::~GroupPlane() { Stop("", -1); }

void GroupPlane::Stop(const std::string& why, int leaver) {
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

std::string GroupPlane::failure() const { return impl_->failure(); }

}  // namespace trainstream::daemon
