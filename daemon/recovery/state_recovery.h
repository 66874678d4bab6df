// Making a dead daemon's optimizer state whole (Note [Optimizer state outlives
// the daemon], trainstream/wire/state_record.h; docs/recovery.md). Pure
// functions over mapped memory: no files, no threads.
//
// A state segment is hostile input like any other (docs/design.md, "Trust
// boundary"): CheckStateSegment reads every offset and count of its manifest
// and recovery records once, checks that each lies inside the segment (and,
// for the slots the updates read and write, inside the staging segment), and
// only then hands out a view of pointers computed from those checked values.
// CompleteUpdates uses the view and nothing else of the header.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "trainstream/status.h"
#include "trainstream/wire/dtype.h"
#include "trainstream/wire/segment_header.h"
#include "trainstream/wire/state_record.h"

namespace trainstream::daemon {

// One parameter of a checked state segment: what the manifest says, checked.
struct CheckedParam {
  uint64_t param_id = 0;
  std::string name;
  uint64_t numel = 0;
  wire::DType dtype = wire::DType::kFloat32;       // the weights it writes back
  wire::DType grad_dtype = wire::DType::kFloat32;  // the slot the engine reads
  uint32_t group = 0;
  // Where the master is (Note [One host copy of a trained weight]): its state
  // array at master_offset (none for kWeightSlot), and for kSplitBf16 and
  // kWeightSlot the param slot.
  wire::MasterLayout master_layout = wire::MasterLayout::kFp32;
  uint64_t master_offset = 0, exp_avg_offset = 0, exp_avg_sq_offset = 0;  // state segment
  uint64_t grad_offset = 0, param_offset = 0;                             // staging segment
  // The clients' gradient slots (a group's local ranks; a solo session's one).
  uint64_t rank_grad_offset = 0, rank_grad_stride = 0;
  wire::DType rank_grad_dtype = wire::DType::kFloat32;
  uint64_t chunk_first = 0, chunks = 0;
  uint64_t step_offset = 0;  // the manifest entry's torch step, from the segment start
};

// Pointers into a state segment mapped at `base`, computed from checked values.
struct StateSegmentView {
  char* base = nullptr;
  uint64_t bytes = 0;
  wire::DType moment_dtype = wire::DType::kFloat32;
  uint64_t seed = 0;
  uint64_t recovery_offset = 0;
  wire::RecoveryHeader* recovery = nullptr;
  wire::ParamRecord* records = nullptr;     // params.size() of them
  wire::ChunkProgress* progress = nullptr;  // total_chunks of them
  char* journal = nullptr;                  // journal_slots of journal_slot_bytes
  uint64_t total_chunks = 0;
  uint64_t chunk_elems = 0;
  uint32_t journal_slots = 0;
  uint64_t journal_slot_bytes = 0;
  uint32_t registration = 0;
  uint32_t owner_uid = 0;
  int32_t owner_pid = 0;
  uint64_t owner_start = 0;
  uint8_t owner_proof[32] = {};
  std::string staging_name;
  uint64_t staging_bytes = 0;
  double max_grad_norm = 0;
  uint32_t threads = 0;
  uint32_t group_ranks = 0;  // a group's local ranks (0: a solo session)
  // The staging segment's gradient pool (recovery version 3; 0 bytes: slots).
  uint64_t grad_pool_offset = 0;
  uint64_t grad_pool_bytes = 0;
  uint32_t world_size = 0;
  uint32_t nnodes = 0;
  std::vector<CheckedParam> params;
};

// Checks the state segment mapped at `base` (`bytes` long, its SegmentHeader
// first) and fills `out`. FAILED_PRECONDITION names the first field that is out
// of place (or "not initialised": a registration that never finished).
Status CheckStateSegment(char* base, uint64_t bytes, StateSegmentView* out);

// The step record the segment holds now (the copy its index names).
wire::StepRecord CurrentStepRecord(const StateSegmentView& v);

// What became of one parameter.
struct ParamOutcome {
  uint64_t param_id = 0;
  uint64_t applied_step = 0;  // last step whose update of it landed (or was skipped)
  bool skipped = false;       // that update was skipped (a non-finite gradient)
  uint64_t torch_step = 0;    // torch's state['step']
  double grad_sumsq = 0;      // of that update's gradient
  bool rolled_forward = false;
};

struct RecoveryReport {
  std::vector<ParamOutcome> params;  // manifest order
  uint64_t restored_subchunks = 0;   // sub-chunks completed from whole redo records
  uint64_t rolled_forward = 0;       // parameters whose update was finished here
  // Non-empty: the state cannot be made whole (names the parameter and the
  // step); nothing of it may be used.
  std::string lost;
  uint64_t lost_step = 0;
};

// Completes the sub-chunks with whole redo records, then finishes every update that had started
// (the Note's rule), reading gradients from and writing weights to the staging
// segment mapped at `staging` (`staging_bytes` long; null when it is gone: then
// an update that must be finished is lost). `decision`: the most advanced step
// record of the session's segments (a clipping decision is written to each).
RecoveryReport CompleteUpdates(const StateSegmentView& v, char* staging, uint64_t staging_bytes,
                               const wire::StepRecord& decision);

}  // namespace trainstream::daemon
