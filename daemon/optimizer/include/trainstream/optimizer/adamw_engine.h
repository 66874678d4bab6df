// AdamWEngine: torch.optim.AdamW over many parameters on a WorkerPool, for the
// daemon's optimizer service. Memory (master, moments, gradient and parameter
// slots) belongs to the caller; the engine only borrows pointers from AddParam
// until it is destroyed. docs/adamw.md describes the modes and guarantees.
//
// Flow per step s:
//   SubmitGrad(id, s, hp) for each parameter whose gradient is in its slot,
//   StepEnd(s) once all of them are submitted.
// Eager mode (no clipping, skip_nonfinite_step false): each parameter is checked
// for non-finite values and updated as soon as it is submitted; a non-finite
// gradient skips that parameter only (its state and slot are untouched) and is
// reported in the step result. Deferred mode (max_grad_norm > 0 or
// skip_nonfinite_step): norms are computed as gradients arrive, updates wait for
// StepEnd, then global norm -> finite check (non-finite skips the whole step) ->
// clip -> update.
//
// Threading: SubmitGrad/StepEnd are thread-safe. Callbacks run on worker threads
// (or, for a step with nothing left to do, on the thread calling StepEnd); they
// must not block for long and must not call WaitIdle.
//
// Durable records: a parameter bound with DurableRecords has its update marked,
// journaled and committed in the caller's memory as it runs (Note [Optimizer
// state outlives the daemon], trainstream/wire/state_record.h), so a process
// killed at any point leaves state that daemon/recovery/ completes. Its
// ParamDone callback comes only after the commit.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "trainstream/kernels/adamw.h"
#include "trainstream/kernels/cpu_features.h"
#include "trainstream/optimizer/worker_pool.h"
#include "trainstream/status.h"
#include "trainstream/wire/state_record.h"

namespace trainstream::optimizer {

using kernels::AdamWHyperParams;
using kernels::DType;

// Where one parameter's crash-consistency records live (a state segment, owned
// by the caller; see the Note above). record null: none are kept, except
// torch_step, kept current whenever it is set.
struct DurableRecords {
  wire::ParamRecord* record = nullptr;
  wire::ChunkProgress* progress = nullptr;  // one per chunk of EngineOptions::chunk_elems
  uint64_t* torch_step = nullptr;           // the manifest entry's step (torch's state['step'])
  uint64_t entry = 0;                       // the parameter's index in its manifest
  char* journal = nullptr;                  // its segment's journal: a slot per pool worker
  uint64_t journal_slot_bytes = 0;
  uint32_t journal_slots = 0;
  wire::RecoveryHeader* header = nullptr;  // its segment's (flags, step records)
};

// One submission's gradient when the parameter has no fixed slot
// (ParamBinding::grad_per_submit): numel elements of its grad dtype at `data`,
// which must not change until the parameter's ParamDone callback. With durable
// records, `record_offset` is what the record says the update reads (the
// gradient's offset in its staging segment), for a restart's roll-forward.
struct GradRef {
  const void* data = nullptr;
  uint64_t record_offset = 0;
};

// One parameter's memory, all owned by the caller and valid for the engine's
// lifetime. exp_avg/exp_avg_sq hold numel elements of the engine's moment dtype.
// param_slot may equal master when param_dtype is fp32 (then there is no
// separate output copy). grad_slot is only read.
struct ParamBinding {
  uint64_t param_id = 0;
  size_t numel = 0;
  DType param_dtype = DType::kFloat32;
  DType grad_dtype = DType::kFloat32;
  float* master = nullptr;
  void* exp_avg = nullptr;
  void* exp_avg_sq = nullptr;
  const void* grad_slot = nullptr;  // null with grad_per_submit
  void* param_slot = nullptr;
  // A split master (Note [Split master] in kernels/bf16.h): bf16 parameters only, with
  // master null. The fp32 master is the bf16 param_slot plus these numel low halves, so
  // the weight copy is not written separately (18 B/param per step instead of 20 with
  // bf16 gradients and moments). The master equals an fp32 master's bits except that a
  // value exactly halfway between two bf16 values that rounded up sits one ulp further
  // from zero. The slot is then half of the master: after Init only the engine writes
  // it (ImportArray to set a master, AdoptWeights to set weights: Note [Weights written
  // from outside the engine]); a bf16 value written there by anyone else is read back
  // with the old low half (a zero with a low half above 0x8000 decodes to NaN) until
  // AdoptWeights takes it.
  uint16_t* master_lo = nullptr;
  DurableRecords durable;  // not with eager_check_per_chunk
  // true: no fixed gradient slot; each SubmitGrad names its gradient (GradRef),
  // as a gradient staging pool's extents move from step to step.
  bool grad_per_submit = false;
};

struct EngineOptions {
  DType moment_dtype = DType::kFloat32;   // kFloat32 or kBFloat16
  double max_grad_norm = 0;               // > 0: clip by global L2 norm (deferred mode)
  bool skip_nonfinite_step = false;       // deferred mode without clipping
  uint64_t seed = 0;                      // stochastic rounding of bf16 moments
  size_t chunk_elems = 64 * 1024;         // elements per work item
  kernels::Isa isa = kernels::BestIsa();  // forced path (tests, benchmarks)
  // Eager mode only. false (default): a parameter's whole gradient is checked
  // before any of it is applied, so a non-finite value leaves that parameter
  // untouched; a parameter larger than one chunk then reads its gradient twice
  // (+4 B/param with fp32 gradients). true: each chunk is checked and updated
  // back to back on one core with its gradient in cache (one read); a chunk with
  // a non-finite value is left untouched, the parameter's other chunks are
  // applied and its step count advances, and it is reported in nonfinite_params.
  // Parameters of at most chunk_elems elements behave the same either way.
  bool eager_check_per_chunk = false;
  // Which of the pool's workers run this engine's chunks: `workers` of them
  // (0: all) starting at `first_worker`, wrapping around the pool.
  unsigned workers = 0;
  unsigned first_worker = 0;
};

struct StepResult {
  uint64_t step = 0;
  double grad_norm = 0;            // global L2 norm of the submitted gradients (pre-clip)
  bool skipped_nonfinite = false;  // some gradient was non-finite
  uint32_t params_updated = 0;
  std::vector<uint64_t> nonfinite_params;  // ids with a non-finite gradient
  Status error;                            // ok when all is well, else what was skipped
};

// updated == false: the parameter was skipped (non-finite); its slot is unchanged.
// param_step is the parameter's torch-style step count after this call.
using ParamDoneCallback =
    std::function<void(uint64_t param_id, uint64_t step, bool updated, uint64_t param_step)>;
using StepDoneCallback = std::function<void(const StepResult& result)>;

class AdamWEngine {
 public:
  // `pool` must outlive the engine.
  AdamWEngine(WorkerPool* pool, EngineOptions options);
  // Ends every step still open (its StepEnd never came: a client died
  // mid-step), then waits for in-flight work (WaitIdle), so no borrowed pointer
  // is used afterwards and destruction never hangs.
  ~AdamWEngine();
  AdamWEngine(const AdamWEngine&) = delete;
  AdamWEngine& operator=(const AdamWEngine&) = delete;

  // Set before the first SubmitGrad; either may be empty.
  void SetCallbacks(ParamDoneCallback param_done, StepDoneCallback step_done);

  // Registers a parameter. Not concurrent with SubmitGrad/StepEnd. Returns OK or
  // an error naming what is wrong: ALREADY_EXISTS (duplicate id), else
  // INVALID_ARGUMENT (no elements, null pointer, unsupported dtype).
  Status AddParam(const ParamBinding& binding);

  // Blocking: for every parameter added since the last Init, sets master from the
  // param slot (any dtype) and zeroes the moments, each chunk on the worker that
  // will later update it (first touch); durable ones' segments are then flagged
  // kRecoveryInitialized.
  Status Init();

  // For every parameter added since the last Init, takes master and moments as
  // they are (state adopted after a restart, daemon/recovery/) instead of Init,
  // and each durable one's torch step from its manifest entry.
  Status AdoptInitialized();

  // Recovery: `param_id`'s update of `step` landed before a restart (its norm
  // `sumsq`, `updated` false when it was skipped). Counted in that step's result
  // as if submitted now, so StepDone reports the whole step's norm.
  Status CarryNorm(uint64_t step, uint64_t param_id, double sumsq, bool updated);

  // The gradient of `param_id` for step `step` is complete in its slot, or, for
  // a parameter bound with grad_per_submit, at `grad` (required then, ignored
  // otherwise). The gradient must not change until the parameter's ParamDone
  // callback. Returns OK or an error: NOT_FOUND (unknown id),
  // FAILED_PRECONDITION (not initialised, busy, step already ended),
  // INVALID_ARGUMENT (bad hyper-parameters, a missing GradRef).
  Status SubmitGrad(uint64_t param_id, uint64_t step, const AdamWHyperParams& hp,
                    const GradRef* grad = nullptr);

  // All gradients of `step` are submitted. StepDone fires once every update of
  // the step is done (possibly before this returns).
  Status StepEnd(uint64_t step);

  // Blocks until every submitted parameter and every ended step is finished.
  void WaitIdle();

  bool deferred() const { return deferred_; }
  const EngineOptions& options() const { return options_; }

  // Elements of a registered parameter (0 when unknown).
  size_t ParamNumel(uint64_t param_id) const;

  // state_dict support; call only while idle. Arrays hold numel floats; `step`
  // is torch's state['step'] (updates applied to this parameter). These and the
  // array calls below are NOT_FOUND for an unknown id.
  Status ExportState(uint64_t param_id, float* master, float* exp_avg, float* exp_avg_sq,
                     uint64_t* step) const;
  // Sets master, moments (bf16 storage: rounded to nearest even) and step, and
  // rewrites the param slot from the new master.
  Status ImportState(uint64_t param_id, const float* master, const float* exp_avg,
                     const float* exp_avg_sq, uint64_t step);

  // One array of a parameter's state, as numel fp32 values (call only while
  // idle). These move one field without touching the others, for state_dict
  // transfers of one field at a time.
  enum class StateArray { kMaster, kExpAvg, kExpAvgSq };
  Status ExportArray(uint64_t param_id, StateArray which, float* out) const;
  // Importing kMaster also rewrites the param slot from it.
  Status ImportArray(uint64_t param_id, StateArray which, const float* in);

  // Note [Weights written from outside the engine]
  // A weight changed after Init by anyone but the engine (a model's load_state_dict,
  // an in-place init or scale of the parameter) must become its master's value, as it
  // does for torch.optim.AdamW over fp32 masters. Otherwise the next update starts
  // from the old master (a resident weight's write is lost) or, where the write went
  // into a split master's slot (a paged weight's home is its slot), from the new high
  // half with the old low half: a value that is neither (a written zero can decode to
  // NaN). So a client hands such weights over before the parameter's next gradient,
  // and the master takes them element by element:
  //   `weights` given (numel elements of the parameter's dtype, `bytes` their size):
  //     each element whose bits differ from the slot's (what the engine last wrote)
  //     is written to the slot and becomes its master exactly (a split master's low
  //     half is zeroed); the others keep their master, low half and all.
  //   `weights` null (`bytes` 0): the slot itself was written. A separate master
  //     takes each slot element that is not its rounding; an fp32 slot is its own
  //     master already; a split master cannot tell a written element from an
  //     unchanged one (the old high half is gone), so every low half is zeroed and
  //     the master is the slot's value exactly.
  // Moments and step are kept. Call only while `param_id` has no update in flight
  // (before its SubmitGrad, or with the engine idle). NOT_FOUND for an unknown id,
  // INVALID_ARGUMENT for a size that is not the parameter's.
  Status AdoptWeights(uint64_t param_id, const void* weights, size_t bytes);
  Status GetStep(uint64_t param_id, uint64_t* step) const;
  Status SetStep(uint64_t param_id, uint64_t step);

 private:
  struct Param;
  struct Step;
  Status OpenStep(uint64_t step, Step** out);  // Requires mu_
  void StartNormPhase(Param* p);
  void NormChunk(Param* p, size_t chunk);
  void CheckAndUpdateChunk(Param* p, size_t chunk);
  void OnNormDone(Param* p);
  void StartUpdatePhase(Param* p, float grad_scale);
  void UpdateChunk(Param* p, size_t chunk);
  void OnParamDone(Param* p, bool updated);
  void FinishDeferredNorms(uint64_t step);
  void MaybeFinishStep(uint64_t step, std::unique_lock<std::mutex>& lock);
  void MarkUpdating(Param* p, float grad_scale);
  void UpdateJournaled(Param* p, size_t chunk);
  // Rewrites every durable segment's step record (the other copy, then the index).
  void WriteStepRecord(const std::function<void(wire::StepRecord*)>& edit);

  WorkerPool* const pool_;
  const EngineOptions options_;
  const bool deferred_;
  ParamDoneCallback param_done_;
  StepDoneCallback step_done_;

  std::vector<std::unique_ptr<Param>> params_;  // append-only before submissions
  std::unordered_map<uint64_t, Param*> by_id_;  // ditto
  std::vector<uint64_t> worker_load_;           // elements assigned per worker
  size_t initialized_ = 0;                      // params_[0, initialized_) are set up

  std::vector<wire::RecoveryHeader*> headers_;  // durable parameters' segments, append-only
  std::mutex records_mu_;                       // serialises WriteStepRecord

  mutable std::mutex mu_;
  std::condition_variable idle_cv_;
  std::map<uint64_t, std::unique_ptr<Step>> steps_;  // Guarded by mu_: open steps
  uint64_t in_flight_ = 0;                           // Guarded by mu_: params submitted, not done
};

}  // namespace trainstream::optimizer
