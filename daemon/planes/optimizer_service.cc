// OptimizerService: one consumer thread per optimizer session, turning ring
// commands into AdamW engine calls and engine callbacks into completions.
//
// Note [Completions never block a worker]. Engine callbacks run on the shared
// worker pool. If they waited for room on a session's completion ring, a client
// that stops polling would stall every other session's updates. So completions
// that don't fit go to a per-session overflow queue (in daemon memory), which the
// session's own thread moves into the ring as the client drains it. Once the
// overflow is non-empty every completion goes through it, so order is kept. The
// queue is bounded (kMaxQueuedCompletions): a client that stops draining past it
// is ended (client_rings.h), so it cannot grow the daemon's memory.
#include "planes/optimizer_service.h"

#include <spdlog/spdlog.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "log_limiter.h"
#include "planes/plane_common.h"
#include "trainstream/optimizer/adamw_engine.h"
#include "trainstream/optimizer/worker_pool.h"

namespace trainstream::daemon {
namespace {

using wire::CommandRecord;
using wire::CompletionRecord;
using wire::CompletionStatus;
using wire::Opcode;
using wire::StateField;

constexpr int64_t kPollSliceNs = 20'000'000;  // how often an idle session thread looks around

}  // namespace

// The data plane of one session. Created by StartSession, destroyed by
// EndSession; between the two the session layer keeps every pointer valid.
class AdamWSessionPlane {
 public:
  AdamWSessionPlane(uint64_t session_id, const ControlRings& rings, RegionResolver resolver,
                    optimizer::WorkerPool* pool, SessionFaultFn on_fault)
      : session_id_(session_id),
        resolver_(std::move(resolver)),
        pool_(pool),
        on_fault_(std::move(on_fault)),
        commands_(rings.command_ring(), rings.capacity),
        completions_(rings.completion_ring(), rings.capacity) {
    thread_ = std::thread([this] { Run(); });
  }

  ~AdamWSessionPlane() {
    stop_.store(true, std::memory_order_release);
    commands_.Wake();
    thread_.join();
    engine_.reset();  // waits for in-flight updates: after this no pointer is touched
  }

  AdamWSessionPlane(const AdamWSessionPlane&) = delete;
  AdamWSessionPlane& operator=(const AdamWSessionPlane&) = delete;

  // Called on an RPC thread; the session thread applies the parameters before
  // it handles the next command (the engine's AddParam is not concurrent with
  // updates).
  Status AddParameters(const SessionOptimizerOptions& options, std::vector<ParamBinding> params) {
    std::lock_guard<std::mutex> lock(pending_mu_);
    if (have_options_) {
      if (options.moment_dtype != options_.moment_dtype ||
          options.max_grad_norm != options_.max_grad_norm || options.seed != options_.seed) {
        return Status(StatusCode::kInvalidArgument,
                      "moment_dtype, max_grad_norm and seed must be the same in every "
                      "RegisterParameters call of a session");
      }
    } else {
      options_ = options;
      have_options_ = true;
    }
    for (auto& p : params) pending_.push_back(std::move(p));
    return Status::Ok();
  }

 private:
  void Run() {
    CommandRecord cmd{};
    while (!stop_.load(std::memory_order_acquire) && !faulted_.load(std::memory_order_acquire)) {
      FlushOverflow();
      const RingResult got = commands_.Pop(&cmd, kPollSliceNs);
      if (got == RingResult::kCorrupt) return Fault(commands_.error());
      if (got != RingResult::kOk) continue;
      ApplyPending();
      Handle(cmd);
    }
  }

  // The client broke the wire rules: its session ends (on the session layer's
  // thread); until then nothing more is read from or written to its rings.
  void Fault(const std::string& why) {
    if (faulted_.exchange(true)) return;
    spdlog::warn("session {}: {}; ending it", session_id_, why);
    if (on_fault_) on_fault_(session_id_, why);
  }

  void ApplyPending() {
    std::vector<ParamBinding> adds;
    {
      std::lock_guard<std::mutex> lock(pending_mu_);
      adds.swap(pending_);
      if (!engine_ && have_options_) {
        optimizer::EngineOptions eo;
        eo.moment_dtype = options_.moment_dtype;
        eo.max_grad_norm = options_.max_grad_norm;
        eo.seed = options_.seed;
        if (options_.threads != 0 && options_.threads < pool_->size()) {
          // Spread limited sessions over the pool instead of stacking them all
          // on workers 0..threads-1.
          static std::atomic<unsigned> next_first{0};
          eo.workers = options_.threads;
          eo.first_worker = next_first.fetch_add(options_.threads) % pool_->size();
        }
        engine_ = std::make_unique<optimizer::AdamWEngine>(pool_, eo);
        engine_->SetCallbacks(
            [this](uint64_t id, uint64_t step, bool updated, uint64_t param_step) {
              OnParamDone(id, step, updated, param_step);
            },
            [this](const optimizer::StepResult& r) { OnStepDone(r); });
      }
    }
    for (auto& b : adds) {
      optimizer::ParamBinding eb;
      eb.param_id = b.param_id;
      eb.numel = b.numel;
      eb.param_dtype = b.param_dtype;
      eb.grad_dtype = b.grad_dtype;
      eb.master = b.master;
      eb.exp_avg = b.exp_avg;
      eb.exp_avg_sq = b.exp_avg_sq;
      eb.grad_slot = b.grad_slot;
      eb.param_slot = b.param_slot;
      Status st = engine_->AddParam(eb);
      if (!st.ok()) {
        Reject(Opcode::kError, 0, b.param_id, 0,
               "param " + std::to_string(b.param_id) + ": " + st.message());
        continue;
      }
      std::lock_guard<std::mutex> lock(step_mu_);
      step_counters_[b.param_id] = b.step_counter;
    }
    if (!adds.empty()) needs_init_ = true;
  }

  void Handle(const CommandRecord& cmd) {
    if (!engine_) {
      Reject(Opcode::kError, cmd.seq, cmd.param_id, cmd.step,
             "no parameters are registered in this session");
      return;
    }
    switch (cmd.opcode) {
      case Opcode::kGradReady: {
        kernels::AdamWHyperParams hp{cmd.lr, cmd.beta1, cmd.beta2, cmd.eps, cmd.weight_decay};
        Status st = engine_->SubmitGrad(cmd.param_id, cmd.step, hp);
        if (!st.ok()) Reject(Opcode::kError, cmd.seq, cmd.param_id, cmd.step, st.message());
        return;
      }
      case Opcode::kStepEnd: {
        Status st = engine_->StepEnd(cmd.step);
        if (!st.ok()) Reject(Opcode::kError, cmd.seq, 0, cmd.step, st.message());
        return;
      }
      case Opcode::kLoadState:
      case Opcode::kExportState:
        HandleState(cmd);
        return;
      case Opcode::kSync: {
        engine_->WaitIdle();
        CompletionRecord rec{};
        rec.opcode = Opcode::kSyncDone;
        rec.seq = cmd.seq;
        Complete(rec);
        return;
      }
      default:
        Reject(Opcode::kError, cmd.seq, cmd.param_id, cmd.step,
               "unknown command opcode " + std::to_string(static_cast<uint32_t>(cmd.opcode)));
    }
  }

  // State moves run between steps: the engine is idle first, so no update races them.
  void HandleState(const CommandRecord& cmd) {
    const bool load = cmd.opcode == Opcode::kLoadState;
    engine_->WaitIdle();
    CompletionRecord rec{};
    rec.opcode = Opcode::kStateDone;
    rec.seq = cmd.seq;
    rec.param_id = cmd.param_id;
    Status st = MoveState(cmd, load, &rec.step);
    if (!st.ok()) {
      rec.status = CompletionStatus::kInvalid;
      SetCompletionMessage(&rec, st.message());
    }
    Complete(rec);
  }

  Status MoveState(const CommandRecord& cmd, bool load, uint64_t* step_out) {
    if (cmd.field == StateField::kParamFromSlot) {
      if (!load) return Status(StatusCode::kInvalidArgument, "kParamFromSlot can only be loaded");
      if (engine_->ParamNumel(cmd.param_id) == 0)
        return Status(StatusCode::kNotFound, "unknown param_id " + std::to_string(cmd.param_id));
      // Init covers every parameter added since the last Init, so the client
      // writes all slots first and then posts these; only the first one works.
      if (needs_init_) {
        needs_init_ = false;
        return engine_->Init();
      }
      return Status::Ok();
    }
    bool imported = false;
    uint64_t imported_step = 0;
    Status st = MoveOptimizerState(*engine_, cmd, resolver_, step_out, &imported, &imported_step);
    if (st.ok() && imported) SetStepCounter(cmd.param_id, imported_step);
    return st;
  }

  void OnParamDone(uint64_t id, uint64_t step, bool updated, uint64_t param_step) {
    if (updated) SetStepCounter(id, param_step);
    CompletionRecord rec{};
    rec.opcode = Opcode::kParamReady;
    rec.status = updated ? CompletionStatus::kOk : CompletionStatus::kSkippedNonFinite;
    rec.param_id = id;
    rec.step = step;
    Complete(rec);
  }

  void OnStepDone(const optimizer::StepResult& r) {
    CompletionRecord rec{};
    rec.opcode = Opcode::kStepDone;
    rec.status = r.skipped_nonfinite ? CompletionStatus::kSkippedNonFinite : CompletionStatus::kOk;
    rec.step = r.step;
    rec.grad_norm = r.grad_norm;
    rec.params_updated = r.params_updated;
    if (!r.error.ok()) SetCompletionMessage(&rec, r.error.message());
    Complete(rec);
  }

  void SetStepCounter(uint64_t id, uint64_t step) {
    std::lock_guard<std::mutex> lock(step_mu_);
    auto it = step_counters_.find(id);
    if (it != step_counters_.end() && it->second != nullptr) *it->second = step;
  }

  void Reject(Opcode op, uint64_t seq, uint64_t param_id, uint64_t step, const std::string& why) {
    if (uint64_t dropped = 0; log_limit_.Allow(&dropped)) {
      spdlog::warn("session {}: rejected command: {}{}", session_id_, why,
                   dropped == 0 ? "" : " (" + std::to_string(dropped) + " more not logged)");
    }
    CompletionRecord rec{};
    rec.opcode = op;
    rec.status = CompletionStatus::kInvalid;
    rec.seq = seq;
    rec.param_id = param_id;
    rec.step = step;
    SetCompletionMessage(&rec, why);
    Complete(rec);
  }

  // See Note [Completions never block a worker].
  void Complete(const CompletionRecord& rec) {
    std::lock_guard<std::mutex> lock(completion_mu_);
    if (faulted_.load(std::memory_order_acquire)) return;
    if (Status st = completions_.Push(rec); !st.ok()) Fault(st.message());
  }

  void FlushOverflow() {
    std::lock_guard<std::mutex> lock(completion_mu_);
    if (faulted_.load(std::memory_order_acquire)) return;
    if (Status st = completions_.Flush(); !st.ok()) Fault(st.message());
  }

  const uint64_t session_id_;
  const RegionResolver resolver_;
  optimizer::WorkerPool* const pool_;
  const SessionFaultFn on_fault_;
  CommandConsumer commands_;     // consumed by thread_ only
  CompletionQueue completions_;  // Guarded by completion_mu_.
  std::atomic<bool> stop_{false};
  std::atomic<bool> faulted_{false};  // set once, by Fault
  LogLimiter log_limit_;

  std::mutex pending_mu_;  // guards pending_, options_, have_options_
  std::vector<ParamBinding> pending_;
  SessionOptimizerOptions options_;
  bool have_options_ = false;

  // Owned by thread_ (created there); reset in the destructor after the join.
  std::unique_ptr<optimizer::AdamWEngine> engine_;
  bool needs_init_ = false;  // thread_ only

  std::mutex step_mu_;  // guards step_counters_ (the manifest's per-param step)
  std::unordered_map<uint64_t, uint64_t*> step_counters_;

  std::mutex completion_mu_;  // guards completions_

  std::thread thread_;  // last: started after every member above exists
};

struct OptimizerService::Impl {
  explicit Impl(unsigned threads) : pool(optimizer::WorkerPoolOptions{threads, false}) {}
  optimizer::WorkerPool pool;
  SessionFaultFn on_fault;  // set before sessions start
  std::mutex mu;            // guards sessions
  std::unordered_map<uint64_t, std::unique_ptr<AdamWSessionPlane>> sessions;
};

OptimizerService::OptimizerService(unsigned threads) : impl_(std::make_unique<Impl>(threads)) {
  spdlog::info("optimizer: {} AdamW worker threads ({} path)", impl_->pool.size(),
               kernels::IsaName(kernels::BestIsa()));
}

OptimizerService::~OptimizerService() {
  std::unordered_map<uint64_t, std::unique_ptr<AdamWSessionPlane>> sessions;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    sessions.swap(impl_->sessions);
  }
  sessions.clear();  // joins each session thread before the pool goes away
}

void OptimizerService::SetFaultHandler(SessionFaultFn on_fault) {
  impl_->on_fault = std::move(on_fault);
}

void OptimizerService::StartSession(uint64_t session_id, const ControlRings& rings,
                                    RegionResolver resolver) {
  auto plane = std::make_unique<AdamWSessionPlane>(session_id, rings, std::move(resolver),
                                                   &impl_->pool, impl_->on_fault);
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->sessions[session_id] = std::move(plane);
}

Status OptimizerService::AddParameters(uint64_t session_id, const SessionOptimizerOptions& options,
                                       std::vector<ParamBinding> params) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto it = impl_->sessions.find(session_id);
  if (it == impl_->sessions.end())
    return Status(StatusCode::kInvalidArgument,
                  "session " + std::to_string(session_id) + " has no data plane");
  return it->second->AddParameters(options, std::move(params));
}

void OptimizerService::EndSession(uint64_t session_id) {
  std::unique_ptr<AdamWSessionPlane> plane;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    auto it = impl_->sessions.find(session_id);
    if (it == impl_->sessions.end()) return;
    plane = std::move(it->second);
    impl_->sessions.erase(it);
  }
  plane.reset();  // outside the lock: joining can take a step's worth of updates
}

unsigned OptimizerService::worker_threads() const { return impl_->pool.size(); }

optimizer::WorkerPool* OptimizerService::pool() { return &impl_->pool; }

}  // namespace trainstream::daemon
