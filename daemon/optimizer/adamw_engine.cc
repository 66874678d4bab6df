// AdamWEngine (adamw_engine.h). Each submitted parameter goes through two
// phases on the workers that own its chunks:
//   norm:   sum of squares of each chunk (double), which also detects non-finite
//           values before anything is written;
//   update: the AdamW kernel on each chunk.
// Eager mode starts the update of a parameter when its own norm phase ends
// (inline, on the same worker, for single-chunk parameters, whose gradient is
// still in cache); deferred mode starts all updates of a step once the step has
// ended and every norm is in.
#include "trainstream/optimizer/adamw_engine.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "trainstream/kernels/bf16.h"
#include "trainstream/optimizer/journaled_update.h"

namespace trainstream::optimizer {

struct AdamWEngine::Param {
  ParamBinding binding;
  size_t index = 0;  // registration order: fixes the order of norm reductions
  struct Chunk {
    size_t offset;
    size_t count;
    unsigned worker;
  };
  std::vector<Chunk> chunks;
  std::vector<double> chunk_sumsq;        // written by the chunk's worker in the norm phase
  std::atomic<size_t> remaining{0};       // chunks left in the current phase
  std::atomic<size_t> chunks_applied{0};  // eager per-chunk check: chunks updated this step

  // The current submission. Written by SubmitGrad while !busy, read by workers
  // after the pool's queue mutex has ordered them.
  uint64_t submit_step = 0;
  AdamWHyperParams hp;
  kernels::AdamWStepScalars scalars{};
  uint64_t new_state_step = 0;
  const void* grad = nullptr;  // the submission's gradient: the slot, or its GradRef
  bool busy = false;           // Guarded by mu_

  uint64_t state_step = 0;  // torch's state['step']; written only by the update phase's last chunk

  size_t ElementBytes(DType t) const { return kernels::DTypeSize(t); }
};

struct AdamWEngine::Step {
  struct Norm {
    size_t index;
    double sumsq;
    Param* param;
    bool carried = false;  // CarryNorm: applied before a restart, not updated here
  };
  std::vector<Norm> norms;  // one per submitted parameter whose norm phase ended
  std::vector<Param*> params;
  size_t norms_pending = 0;    // submitted parameters still in their norm phase
  size_t updates_pending = 0;  // submitted parameters not yet done
  bool ended = false;
  bool updates_started = false;  // deferred mode
  StepResult result;
};

namespace {

Status CheckHyperParams(const AdamWHyperParams& hp) {
  if (!(hp.lr >= 0))
    return Status(StatusCode::kInvalidArgument,
                  "invalid learning rate " + std::to_string(hp.lr) + " (need >= 0)");
  if (!(hp.beta1 >= 0 && hp.beta1 < 1))
    return Status(StatusCode::kInvalidArgument, "invalid beta1 " + std::to_string(hp.beta1));
  if (!(hp.beta2 >= 0 && hp.beta2 < 1))
    return Status(StatusCode::kInvalidArgument, "invalid beta2 " + std::to_string(hp.beta2));
  if (!(hp.eps >= 0))
    return Status(StatusCode::kInvalidArgument, "invalid eps " + std::to_string(hp.eps));
  if (!(hp.weight_decay >= 0))
    return Status(StatusCode::kInvalidArgument,
                  "invalid weight_decay " + std::to_string(hp.weight_decay));
  return Status::Ok();
}

// Whether element i of a separate master's param slot is what the engine writes there
// (the master rounded to the slot's dtype).
bool SlotIsMastersRounding(const ParamBinding& b, size_t i) {
  const char* s = static_cast<const char*>(b.param_slot) + i * kernels::DTypeSize(b.param_dtype);
  const float m = b.master[i];
  uint16_t rounded = 0;
  switch (b.param_dtype) {
    case DType::kFloat32:
      return std::memcmp(s, &m, sizeof(float)) == 0;
    case DType::kBFloat16:
      rounded = kernels::FloatToBf16Rne(m);
      break;
    case DType::kFloat16:
      rounded = kernels::FloatToFp16Rne(m);
      break;
  }
  return std::memcmp(s, &rounded, sizeof(rounded)) == 0;
}

double OrderedSum(std::vector<double> parts) {
  double total = 0;
  for (double x : parts) total += x;
  return total;
}

// A one-shot countdown for blocking calls (Init).
class Latch {
 public:
  explicit Latch(size_t count) : count_(count) {}
  void CountDown() {
    std::lock_guard<std::mutex> lock(mu_);
    if (--count_ == 0) cv_.notify_all();
  }
  void Wait() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return count_ == 0; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  size_t count_;  // Guarded by mu_
};

}  // namespace

AdamWEngine::AdamWEngine(WorkerPool* pool, EngineOptions options)
    : pool_(pool),
      options_(options),
      deferred_(options.max_grad_norm > 0 || options.skip_nonfinite_step),
      worker_load_(
          options.workers == 0 || options.workers > pool->size() ? pool->size() : options.workers,
          0) {}

AdamWEngine::~AdamWEngine() {
  // A step whose StepEnd never came (its client died mid-step) would keep a
  // deferred step's submissions in flight forever, and WaitIdle with them: end
  // such steps first. Their results go to callbacks the owner is discarding.
  std::vector<uint64_t> open;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [step, s] : steps_) {
      if (!s->ended) open.push_back(step);
    }
  }
  for (uint64_t step : open) StepEnd(step);
  WaitIdle();
}

void AdamWEngine::SetCallbacks(ParamDoneCallback param_done, StepDoneCallback step_done) {
  param_done_ = std::move(param_done);
  step_done_ = std::move(step_done);
}

Status AdamWEngine::AddParam(const ParamBinding& b) {
  if (by_id_.count(b.param_id))
    return Status(StatusCode::kAlreadyExists,
                  "parameter " + std::to_string(b.param_id) + " already added");
  if (b.numel == 0)
    return Status(StatusCode::kInvalidArgument,
                  "parameter " + std::to_string(b.param_id) + " has no elements");
  const bool split = b.master_lo != nullptr;
  if ((!b.master && !split) || !b.exp_avg || !b.exp_avg_sq ||
      (!b.grad_slot && !b.grad_per_submit) || !b.param_slot) {
    return Status(StatusCode::kInvalidArgument,
                  "parameter " + std::to_string(b.param_id) + ": null pointer in binding");
  }
  if (split && (b.master != nullptr || b.param_dtype != DType::kBFloat16)) {
    return Status(StatusCode::kInvalidArgument,
                  "parameter " + std::to_string(b.param_id) +
                      ": a split master (master_lo) needs a bf16 param_slot and no fp32 master");
  }
  if (options_.moment_dtype == DType::kFloat16)
    return Status(StatusCode::kInvalidArgument, "moments must be fp32 or bf16, not fp16");
  if (b.param_slot == static_cast<void*>(b.master) && b.param_dtype != DType::kFloat32) {
    return Status(StatusCode::kInvalidArgument,
                  "parameter " + std::to_string(b.param_id) +
                      ": param_slot may alias master only for fp32 parameters");
  }
  const DurableRecords& d = b.durable;
  const size_t chunk = std::max<size_t>(options_.chunk_elems, 64);
  if (d.record != nullptr) {
    if (options_.eager_check_per_chunk)
      return Status(StatusCode::kInvalidArgument,
                    "parameter " + std::to_string(b.param_id) +
                        ": durable records need eager_check_per_chunk off");
    const uint64_t chunks = (b.numel + chunk - 1) / chunk;
    const uint64_t slot_bytes =
        wire::JournalSlotLayoutFor(wire::kSubChunkElems, kernels::DTypeSize(options_.moment_dtype))
            .bytes;
    if (d.progress == nullptr || d.torch_step == nullptr || d.journal == nullptr ||
        d.header == nullptr || d.record->chunks != chunks || d.journal_slots < pool_->size() ||
        d.journal_slot_bytes < slot_bytes) {
      return Status(StatusCode::kInvalidArgument,
                    "parameter " + std::to_string(b.param_id) +
                        ": durable records do not fit the engine (chunks, journal slots)");
    }
  }
  auto p = std::make_unique<Param>();
  p->binding = b;
  p->grad = b.grad_slot;
  p->index = params_.size();
  for (size_t off = 0; off < b.numel; off += chunk) {
    const size_t count = std::min(chunk, b.numel - off);
    // Least-loaded worker: spreads big tensors over all workers and packs small
    // ones, and the mapping never changes (first touch, Init).
    const unsigned worker = static_cast<unsigned>(
        std::min_element(worker_load_.begin(), worker_load_.end()) - worker_load_.begin());
    worker_load_[worker] += count;
    p->chunks.push_back(
        {off, count, static_cast<unsigned>((options_.first_worker + worker) % pool_->size())});
  }
  p->chunk_sumsq.assign(p->chunks.size(), 0.0);
  if (d.header != nullptr &&
      std::find(headers_.begin(), headers_.end(), d.header) == headers_.end())
    headers_.push_back(d.header);
  by_id_[b.param_id] = p.get();
  params_.push_back(std::move(p));
  return Status::Ok();
}

Status AdamWEngine::Init() {
  size_t tasks = 0;
  for (size_t i = initialized_; i < params_.size(); ++i) tasks += params_[i]->chunks.size();
  Latch latch(tasks);
  const size_t moment_bytes = kernels::DTypeSize(options_.moment_dtype);
  for (size_t i = initialized_; i < params_.size(); ++i) {
    Param* p = params_[i].get();
    for (const Param::Chunk& c : p->chunks) {
      pool_->Submit(c.worker, [p, c, moment_bytes, &latch] {
        const ParamBinding& b = p->binding;
        if (b.master_lo != nullptr) {  // the bf16 slot is the master exactly
          std::memset(b.master_lo + c.offset, 0, c.count * sizeof(uint16_t));
        } else if (b.param_slot != static_cast<void*>(b.master)) {
          kernels::ConvertToFloat(
              static_cast<const char*>(b.param_slot) + c.offset * kernels::DTypeSize(b.param_dtype),
              b.param_dtype, b.master + c.offset, c.count);
        }
        std::memset(static_cast<char*>(b.exp_avg) + c.offset * moment_bytes, 0,
                    c.count * moment_bytes);
        std::memset(static_cast<char*>(b.exp_avg_sq) + c.offset * moment_bytes, 0,
                    c.count * moment_bytes);
        latch.CountDown();
      });
    }
  }
  latch.Wait();
  for (size_t i = initialized_; i < params_.size(); ++i) {
    if (wire::RecoveryHeader* h = params_[i]->binding.durable.header; h != nullptr)
      h->flags.fetch_or(wire::kRecoveryInitialized, std::memory_order_release);
  }
  initialized_ = params_.size();
  return Status::Ok();
}

Status AdamWEngine::AdoptInitialized() {
  for (size_t i = initialized_; i < params_.size(); ++i) {
    const DurableRecords& d = params_[i]->binding.durable;
    if (d.torch_step != nullptr) params_[i]->state_step = *d.torch_step;
  }
  initialized_ = params_.size();
  return Status::Ok();
}

// The step's record, made on first use; a step already ended takes nothing more.
// Requires mu_.
Status AdamWEngine::OpenStep(uint64_t step, Step** out) {
  std::unique_ptr<Step>& s = steps_[step];
  if (!s) {
    s = std::make_unique<Step>();
    s->result.step = step;
  }
  if (s->ended)
    return Status(StatusCode::kFailedPrecondition,
                  "step " + std::to_string(step) + " already ended");
  *out = s.get();
  return Status::Ok();
}

Status AdamWEngine::CarryNorm(uint64_t step, uint64_t param_id, double sumsq, bool updated) {
  auto it = by_id_.find(param_id);
  if (it == by_id_.end())
    return Status(StatusCode::kNotFound, "unknown parameter " + std::to_string(param_id));
  std::lock_guard<std::mutex> lock(mu_);
  Step* s = nullptr;
  if (Status st = OpenStep(step, &s); !st.ok()) return st;
  s->norms.push_back({it->second->index, sumsq, it->second, /*carried=*/true});
  if (updated) {
    ++s->result.params_updated;
  } else {
    s->result.skipped_nonfinite = true;
    if (!std::isfinite(sumsq)) s->result.nonfinite_params.push_back(param_id);
  }
  return Status::Ok();
}

Status AdamWEngine::SubmitGrad(uint64_t param_id, uint64_t step, const AdamWHyperParams& hp,
                               const GradRef* grad) {
  auto it = by_id_.find(param_id);
  if (it == by_id_.end())
    return Status(StatusCode::kNotFound, "unknown parameter " + std::to_string(param_id));
  Param* p = it->second;
  if (p->index >= initialized_)
    return Status(StatusCode::kFailedPrecondition,
                  "parameter " + std::to_string(param_id) + " not initialised (Init)");
  if (Status st = CheckHyperParams(hp); !st.ok()) return st;
  const bool per_submit = p->binding.grad_per_submit;
  if (per_submit && (grad == nullptr || grad->data == nullptr))
    return Status(StatusCode::kInvalidArgument,
                  "parameter " + std::to_string(param_id) + " needs its gradient named (GradRef)");
  wire::ParamRecord* record = p->binding.durable.record;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (p->busy) {
      return Status(StatusCode::kFailedPrecondition, "parameter " + std::to_string(param_id) +
                                                         " still has an update in flight (step " +
                                                         std::to_string(p->submit_step) + ")");
    }
    Step* s = nullptr;
    if (Status st = OpenStep(step, &s); !st.ok()) return st;
    p->busy = true;
    p->submit_step = step;
    p->hp = hp;
    if (per_submit) {
      p->grad = grad->data;
      // Before the mark: a restart rolls a marked update forward from the bytes
      // the record names. !busy means the last update stored `applied`, so no
      // record whose grad_offset changes here asks for a roll-forward.
      if (record != nullptr) {
        record->grad_offset = grad->record_offset;
        record->rank_grad_offset = grad->record_offset;
      }
    }
    s->params.push_back(p);
    ++s->norms_pending;
    ++s->updates_pending;
    ++in_flight_;
  }
  if (record != nullptr)
    record->mark.store(step * 4 + wire::kMarkSubmitted, std::memory_order_release);
  StartNormPhase(p);
  return Status::Ok();
}

Status AdamWEngine::StepEnd(uint64_t step) {
  std::unique_lock<std::mutex> lock(mu_);
  Step* s = nullptr;
  if (Status st = OpenStep(step, &s); !st.ok()) return st;
  s->ended = true;
  if (deferred_ && s->norms_pending == 0 && !s->params.empty() && !s->updates_started) {
    s->updates_started = true;
    lock.unlock();
    FinishDeferredNorms(step);
    return Status::Ok();
  }
  MaybeFinishStep(step, lock);
  return Status::Ok();
}

void AdamWEngine::WaitIdle() {
  std::unique_lock<std::mutex> lock(mu_);
  idle_cv_.wait(lock, [this] {
    if (in_flight_ != 0) return false;
    for (const auto& [id, s] : steps_) {
      if (s->ended) return false;
    }
    return true;
  });
}

void AdamWEngine::StartNormPhase(Param* p) {
  p->remaining.store(p->chunks.size(), std::memory_order_relaxed);
  if (!deferred_ && options_.eager_check_per_chunk && p->chunks.size() > 1) {
    // One pass: each chunk is checked and, if finite, updated while in cache.
    p->new_state_step = p->state_step + 1;
    p->scalars = kernels::ComputeAdamWStepScalars(p->hp, p->new_state_step, 1.0f);
    p->chunks_applied.store(0, std::memory_order_relaxed);
    for (size_t c = 0; c < p->chunks.size(); ++c) {
      pool_->Submit(p->chunks[c].worker, [this, p, c] { CheckAndUpdateChunk(p, c); });
    }
    return;
  }
  for (size_t c = 0; c < p->chunks.size(); ++c) {
    pool_->Submit(p->chunks[c].worker, [this, p, c] { NormChunk(p, c); });
  }
}

void AdamWEngine::NormChunk(Param* p, size_t chunk) {
  const Param::Chunk& c = p->chunks[chunk];
  const ParamBinding& b = p->binding;
  p->chunk_sumsq[chunk] = kernels::GradSumSquares(
      static_cast<const char*>(p->grad) + c.offset * kernels::DTypeSize(b.grad_dtype), b.grad_dtype,
      c.count, options_.isa);
  if (p->remaining.fetch_sub(1, std::memory_order_acq_rel) == 1) OnNormDone(p);
}

void AdamWEngine::CheckAndUpdateChunk(Param* p, size_t chunk) {
  const Param::Chunk& c = p->chunks[chunk];
  const ParamBinding& b = p->binding;
  const double sumsq = kernels::GradSumSquares(
      static_cast<const char*>(p->grad) + c.offset * kernels::DTypeSize(b.grad_dtype), b.grad_dtype,
      c.count, options_.isa);
  p->chunk_sumsq[chunk] = sumsq;
  if (std::isfinite(sumsq)) {
    p->remaining.fetch_add(1, std::memory_order_relaxed);  // UpdateChunk counts it down
    UpdateChunk(p, chunk);                                 // never the last: we still hold one
    p->chunks_applied.fetch_add(1, std::memory_order_relaxed);
  }
  if (p->remaining.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  const double total = OrderedSum(p->chunk_sumsq);
  {
    std::lock_guard<std::mutex> lock(mu_);
    Step* s = steps_[p->submit_step].get();
    s->norms.push_back({p->index, total, p});
    --s->norms_pending;
  }
  const bool applied = p->chunks_applied.load(std::memory_order_relaxed) > 0;
  if (applied) p->state_step = p->new_state_step;
  OnParamDone(p, applied);
}

void AdamWEngine::OnNormDone(Param* p) {
  const double sumsq = OrderedSum(p->chunk_sumsq);
  const bool finite = std::isfinite(sumsq);
  // For a restart to carry into the step's norm once the update has landed.
  if (wire::ParamRecord* r = p->binding.durable.record; r != nullptr) r->grad_sumsq = sumsq;
  std::unique_lock<std::mutex> lock(mu_);
  Step* s = steps_[p->submit_step].get();
  s->norms.push_back({p->index, sumsq, p});
  --s->norms_pending;
  if (!deferred_) {
    lock.unlock();
    if (finite) {
      MarkUpdating(p, 1.0f);
      StartUpdatePhase(p, 1.0f);
    } else {
      OnParamDone(p, false);
    }
    return;
  }
  if (s->ended && s->norms_pending == 0 && !s->updates_started) {
    s->updates_started = true;
    const uint64_t step = p->submit_step;
    lock.unlock();
    FinishDeferredNorms(step);
  }
}

// Deferred mode, once per step: every norm is in and no new submission can join.
void AdamWEngine::FinishDeferredNorms(uint64_t step) {
  Step* s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    s = steps_[step].get();
  }
  // s->norms and s->params no longer change: the step ended and all norms are in.
  std::sort(s->norms.begin(), s->norms.end(),
            [](const Step::Norm& a, const Step::Norm& b) { return a.index < b.index; });
  double total = 0;
  std::vector<std::pair<Param*, double>> params;  // a copy: the last completion below frees *s
  for (const Step::Norm& n : s->norms) {
    total += n.sumsq;
    if (!n.carried) params.emplace_back(n.param, n.sumsq);
  }
  // Note [Optimizer state outlives the daemon]: the step's decision is recorded
  // after every parameter's mark and before the first update (or skip), so a
  // restart finds it applied to all of the step's parameters or to none.
  if (!std::isfinite(total)) {
    if (!headers_.empty()) {
      WriteStepRecord([step](wire::StepRecord* r) {
        r->decided_step = step;
        r->decided_scale = 1.0f;
        r->decided_skipped = 1;
      });
    }
    for (const auto& [p, sumsq] : params) OnParamDone(p, false);
    return;
  }
  float scale = 1.0f;
  if (options_.max_grad_norm > 0) {
    // torch.nn.utils.clip_grad_norm_: the norm is a float tensor and
    // max_norm / (norm + 1e-6) is evaluated as reciprocal(norm + 1e-6) * max_norm.
    const float norm = static_cast<float>(std::sqrt(total));
    const float coef = (1.0f / (norm + 1e-6f)) * static_cast<float>(options_.max_grad_norm);
    if (coef < 1.0f) scale = coef;
  }
  for (const auto& [p, sumsq] : params) MarkUpdating(p, scale);
  if (!headers_.empty()) {
    WriteStepRecord([step, scale](wire::StepRecord* r) {
      r->decided_step = step;
      r->decided_scale = scale;
      r->decided_skipped = 0;
    });
  }
  for (const auto& [p, sumsq] : params) StartUpdatePhase(p, scale);
}

void AdamWEngine::MarkUpdating(Param* p, float grad_scale) {
  p->new_state_step = p->state_step + 1;
  p->scalars = kernels::ComputeAdamWStepScalars(p->hp, p->new_state_step, grad_scale);
  wire::ParamRecord* r = p->binding.durable.record;
  if (r == nullptr) return;
  // The mark still names an earlier step (or this one, submitted): a crash
  // while these are rewritten finds nothing to roll forward from them.
  r->state_step = p->new_state_step;
  r->lr = p->hp.lr;
  r->beta1 = p->hp.beta1;
  r->beta2 = p->hp.beta2;
  r->eps = p->hp.eps;
  r->weight_decay = p->hp.weight_decay;
  r->grad_scale = grad_scale;
  r->mark.store(p->submit_step * 4 + wire::kMarkUpdating, std::memory_order_release);
}

void AdamWEngine::WriteStepRecord(const std::function<void(wire::StepRecord*)>& edit) {
  std::lock_guard<std::mutex> lock(records_mu_);
  for (wire::RecoveryHeader* h : headers_) {
    const uint32_t current = h->current_step_record.load(std::memory_order_relaxed) & 1u;
    wire::StepRecord next = h->step_records[current];
    edit(&next);
    h->step_records[1 - current] = next;
    h->current_step_record.store(1 - current, std::memory_order_release);
  }
}

// MarkUpdating has set the update's step and scalars.
void AdamWEngine::StartUpdatePhase(Param* p, float /*grad_scale*/) {
  p->remaining.store(p->chunks.size(), std::memory_order_relaxed);
  const int here = WorkerPool::CurrentWorker();
  if (p->chunks.size() == 1 && here == static_cast<int>(p->chunks[0].worker)) {
    UpdateChunk(p, 0);  // gradient still in this core's cache from the norm pass
    return;
  }
  for (size_t c = 0; c < p->chunks.size(); ++c) {
    pool_->Submit(p->chunks[c].worker, [this, p, c] { UpdateChunk(p, c); });
  }
}

void AdamWEngine::UpdateChunk(Param* p, size_t chunk) {
  if (p->binding.durable.record != nullptr) return UpdateJournaled(p, chunk);
  const Param::Chunk& c = p->chunks[chunk];
  const ParamBinding& b = p->binding;
  kernels::AdamWRange whole;  // the parameter's arrays; this chunk's slice is updated
  whole.master = b.master;
  whole.master_lo = b.master_lo;
  whole.exp_avg = b.exp_avg;
  whole.exp_avg_sq = b.exp_avg_sq;
  whole.grad = p->grad;
  whole.param_out = b.param_slot;
  whole.numel = b.numel;
  whole.grad_dtype = b.grad_dtype;
  whole.moment_dtype = options_.moment_dtype;
  whole.param_dtype = b.param_dtype;
  kernels::RoundingKey key{options_.seed, b.param_id, p->new_state_step, c.offset};
  kernels::AdamWUpdate(whole.Slice(c.offset, c.count), p->scalars, key, options_.isa);
  if (p->remaining.fetch_sub(1, std::memory_order_acq_rel) == 1) {
    p->state_step = p->new_state_step;
    OnParamDone(p, true);
  }
}

// Note [Optimizer state outlives the daemon]: ApplyJournaled, in this worker's
// journal slot. The chunk's progress starts at 0: every earlier update of it is
// whole (applied here, or rolled forward after a restart).
void AdamWEngine::UpdateJournaled(Param* p, size_t chunk) {
  const Param::Chunk& c = p->chunks[chunk];
  const ParamBinding& b = p->binding;
  const DurableRecords& d = b.durable;
  JournaledChunk j;
  j.whole.master = b.master;
  j.whole.master_lo = b.master_lo;
  j.whole.exp_avg = b.exp_avg;
  j.whole.exp_avg_sq = b.exp_avg_sq;
  j.whole.grad = p->grad;
  j.whole.param_out = b.param_slot;
  j.whole.numel = b.numel;
  j.whole.grad_dtype = b.grad_dtype;
  j.whole.moment_dtype = options_.moment_dtype;
  j.whole.param_dtype = b.param_dtype;
  j.scalars = p->scalars;
  j.key = kernels::RoundingKey{options_.seed, b.param_id, p->new_state_step, 0};
  j.isa = options_.isa;
  j.entry = d.entry;
  j.step = p->submit_step;
  j.chunk_offset = c.offset;
  j.chunk_count = c.count;
  j.journal_slot = d.journal + static_cast<uint64_t>(c.worker) * d.journal_slot_bytes;
  j.progress = &d.progress[chunk];
  ApplyJournaled(j, 0);
  if (p->remaining.fetch_sub(1, std::memory_order_acq_rel) == 1) {
    p->state_step = p->new_state_step;
    OnParamDone(p, true);
  }
}

void AdamWEngine::OnParamDone(Param* p, bool updated) {
  const uint64_t id = p->binding.param_id;
  const DurableRecords& d = p->binding.durable;
  if (updated && d.torch_step != nullptr) *d.torch_step = p->state_step;
  // The commit: after every chunk, before anyone hears of it.
  if (d.record != nullptr)
    d.record->applied.store(p->submit_step * 2 + (updated ? 0 : 1), std::memory_order_release);
  uint64_t step;
  uint64_t state_step;
  {
    std::lock_guard<std::mutex> lock(mu_);
    step = p->submit_step;
    state_step = p->state_step;
    Step* s = steps_[step].get();
    if (updated) {
      ++s->result.params_updated;
      if (options_.eager_check_per_chunk && !deferred_) {
        for (const Step::Norm& n : s->norms) {
          if (n.param == p && !std::isfinite(n.sumsq)) {
            s->result.nonfinite_params.push_back(id);  // partly applied (per-chunk check)
            s->result.skipped_nonfinite = true;
          }
        }
      }
    } else {
      // In a skipped deferred step, only the parameters whose own gradient was
      // non-finite are listed; the others were finite but held back.
      for (const Step::Norm& n : s->norms) {
        if (n.param == p && !std::isfinite(n.sumsq)) s->result.nonfinite_params.push_back(id);
      }
      s->result.skipped_nonfinite = true;
    }
    p->busy = false;
  }
  if (param_done_) param_done_(id, step, updated, state_step);
  std::unique_lock<std::mutex> lock(mu_);
  --steps_[step]->updates_pending;
  --in_flight_;
  MaybeFinishStep(step, lock);
  idle_cv_.notify_all();
}

void AdamWEngine::MaybeFinishStep(uint64_t step, std::unique_lock<std::mutex>& lock) {
  auto it = steps_.find(step);
  if (it == steps_.end()) return;
  Step* s = it->second.get();
  if (!s->ended || s->updates_pending != 0 || s->norms_pending != 0) return;
  std::unique_ptr<Step> done = std::move(it->second);
  steps_.erase(it);
  ++in_flight_;  // keeps WaitIdle waiting until the callback has returned
  lock.unlock();

  std::sort(done->norms.begin(), done->norms.end(),
            [](const Step::Norm& a, const Step::Norm& b) { return a.index < b.index; });
  double total = 0;
  for (const Step::Norm& n : done->norms) total += n.sumsq;
  StepResult& r = done->result;
  r.grad_norm = std::sqrt(total);
  std::sort(r.nonfinite_params.begin(), r.nonfinite_params.end());
  if (r.skipped_nonfinite) {
    // std::string, not a stream: see Note [No iostreams in _C] (python/csrc/check.h).
    std::string msg = "non-finite gradient in parameter(s)";
    for (uint64_t id : r.nonfinite_params) msg += " " + std::to_string(id);
    msg += " at step " + std::to_string(step);
    msg += deferred_ ? ": whole step skipped, no state changed"
           : options_.eager_check_per_chunk
               ? ": their chunks with non-finite values were not updated, everything else was"
               : ": those parameters were not updated, the others were";
    r.error = Status(StatusCode::kInvalidArgument, msg);
  }
  if (!headers_.empty()) {
    WriteStepRecord([&r](wire::StepRecord* rec) {
      rec->completed_step = r.step;
      rec->completed_grad_norm = r.grad_norm;
      rec->completed_status = r.skipped_nonfinite ? 1 : 0;  // CompletionStatus numbers
      rec->completed_params_updated = r.params_updated;
    });
  }
  if (step_done_) step_done_(r);

  lock.lock();
  --in_flight_;
  idle_cv_.notify_all();
}

size_t AdamWEngine::ParamNumel(uint64_t param_id) const {
  auto it = by_id_.find(param_id);
  return it == by_id_.end() ? 0 : it->second->binding.numel;
}

Status AdamWEngine::ExportState(uint64_t param_id, float* master, float* exp_avg, float* exp_avg_sq,
                                uint64_t* step) const {
  Status st = ExportArray(param_id, StateArray::kMaster, master);
  if (st.ok()) st = ExportArray(param_id, StateArray::kExpAvg, exp_avg);
  if (st.ok()) st = ExportArray(param_id, StateArray::kExpAvgSq, exp_avg_sq);
  if (st.ok()) st = GetStep(param_id, step);
  return st;
}

Status AdamWEngine::ImportState(uint64_t param_id, const float* master, const float* exp_avg,
                                const float* exp_avg_sq, uint64_t step) {
  Status st = ImportArray(param_id, StateArray::kMaster, master);
  if (st.ok()) st = ImportArray(param_id, StateArray::kExpAvg, exp_avg);
  if (st.ok()) st = ImportArray(param_id, StateArray::kExpAvgSq, exp_avg_sq);
  if (st.ok()) st = SetStep(param_id, step);
  return st;
}

Status AdamWEngine::ExportArray(uint64_t param_id, StateArray which, float* out) const {
  auto it = by_id_.find(param_id);
  if (it == by_id_.end())
    return Status(StatusCode::kNotFound, "unknown parameter " + std::to_string(param_id));
  const ParamBinding& b = it->second->binding;
  switch (which) {
    case StateArray::kMaster:
      if (b.master_lo != nullptr) {
        const auto* hi = static_cast<const uint16_t*>(b.param_slot);
        for (size_t i = 0; i < b.numel; ++i)
          out[i] = kernels::SplitMasterDecode(hi[i], b.master_lo[i]);
      } else {
        std::memcpy(out, b.master, b.numel * sizeof(float));
      }
      break;
    case StateArray::kExpAvg:
      kernels::ConvertToFloat(b.exp_avg, options_.moment_dtype, out, b.numel);
      break;
    case StateArray::kExpAvgSq:
      kernels::ConvertToFloat(b.exp_avg_sq, options_.moment_dtype, out, b.numel);
      break;
  }
  return Status::Ok();
}

Status AdamWEngine::ImportArray(uint64_t param_id, StateArray which, const float* in) {
  auto it = by_id_.find(param_id);
  if (it == by_id_.end())
    return Status(StatusCode::kNotFound, "unknown parameter " + std::to_string(param_id));
  const ParamBinding& b = it->second->binding;
  if (which == StateArray::kMaster && b.master_lo != nullptr) {
    auto* hi = static_cast<uint16_t*>(b.param_slot);
    for (size_t i = 0; i < b.numel; ++i) kernels::SplitMasterEncode(in[i], &hi[i], &b.master_lo[i]);
    return Status::Ok();
  }
  if (which == StateArray::kMaster) {
    std::memmove(b.master, in, b.numel * sizeof(float));
    if (b.param_slot == static_cast<void*>(b.master)) return Status::Ok();
    for (size_t i = 0; i < b.numel; ++i) {
      switch (b.param_dtype) {
        case DType::kFloat32:
          static_cast<float*>(b.param_slot)[i] = b.master[i];
          break;
        case DType::kBFloat16:
          static_cast<uint16_t*>(b.param_slot)[i] = kernels::FloatToBf16Rne(b.master[i]);
          break;
        case DType::kFloat16:
          static_cast<uint16_t*>(b.param_slot)[i] = kernels::FloatToFp16Rne(b.master[i]);
          break;
      }
    }
    return Status::Ok();
  }
  void* dst = which == StateArray::kExpAvg ? b.exp_avg : b.exp_avg_sq;
  if (options_.moment_dtype == DType::kBFloat16) {
    for (size_t i = 0; i < b.numel; ++i)
      static_cast<uint16_t*>(dst)[i] = kernels::FloatToBf16Rne(in[i]);
  } else {
    std::memmove(dst, in, b.numel * sizeof(float));
  }
  return Status::Ok();
}

// Note [Weights written from outside the engine] (adamw_engine.h).
Status AdamWEngine::AdoptWeights(uint64_t param_id, const void* weights, size_t bytes) {
  auto it = by_id_.find(param_id);
  if (it == by_id_.end())
    return Status(StatusCode::kNotFound, "unknown parameter " + std::to_string(param_id));
  const ParamBinding& b = it->second->binding;
  const size_t es = kernels::DTypeSize(b.param_dtype);
  if (weights != nullptr ? bytes != b.numel * es : bytes != 0) {
    return Status(StatusCode::kInvalidArgument,
                  "weights of parameter " + std::to_string(param_id) + " are " +
                      std::to_string(bytes) + " bytes; it needs " + std::to_string(b.numel * es) +
                      " (or 0: its slot holds them)");
  }
  const auto* in = static_cast<const char*>(weights);  // the client's: read with memcpy
  auto* slot = static_cast<char*>(b.param_slot);
  if (b.master_lo != nullptr) {
    auto* hi = static_cast<uint16_t*>(b.param_slot);
    for (size_t i = 0; i < b.numel; ++i) {
      uint16_t w = hi[i];
      if (in != nullptr) std::memcpy(&w, in + i * 2, 2);
      if (in == nullptr || w != hi[i]) {
        hi[i] = w;
        b.master_lo[i] = 0;
      }
    }
    return Status::Ok();
  }
  if (b.param_slot == static_cast<void*>(b.master)) {  // an fp32 slot is its own master
    if (in != nullptr) std::memmove(slot, in, bytes);
    return Status::Ok();
  }
  for (size_t i = 0; i < b.numel; ++i) {
    char* s = slot + i * es;
    if (in != nullptr) {
      if (std::memcmp(in + i * es, s, es) == 0) continue;
      std::memmove(s, in + i * es, es);
    } else if (SlotIsMastersRounding(b, i)) {
      continue;
    }
    kernels::ConvertToFloat(s, b.param_dtype, &b.master[i], 1);
  }
  return Status::Ok();
}

Status AdamWEngine::GetStep(uint64_t param_id, uint64_t* step) const {
  auto it = by_id_.find(param_id);
  if (it == by_id_.end())
    return Status(StatusCode::kNotFound, "unknown parameter " + std::to_string(param_id));
  *step = it->second->state_step;
  return Status::Ok();
}

Status AdamWEngine::SetStep(uint64_t param_id, uint64_t step) {
  auto it = by_id_.find(param_id);
  if (it == by_id_.end())
    return Status(StatusCode::kNotFound, "unknown parameter " + std::to_string(param_id));
  it->second->state_step = step;
  if (uint64_t* torch_step = it->second->binding.durable.torch_step; torch_step != nullptr)
    *torch_step = step;
  return Status::Ok();
}

}  // namespace trainstream::optimizer
