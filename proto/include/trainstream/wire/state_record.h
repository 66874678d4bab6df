// What a state segment keeps so that its optimizer state outlives the daemon:
// the recovery header, a record per parameter, progress per chunk and a redo
// journal per worker. Daemon only (the segment is the daemon's, 0600); the
// daemon that adopts a segment checks every field before it uses one.
//
// Note [Optimizer state outlives the daemon] (docs/recovery.md has the whole
// story). A daemon killed mid-update leaves parameters part new, part old; an
// in-place AdamW update can be neither undone nor inverted. So the engine
// (daemon/optimizer/adamw_engine.cc) writes, in this order, for each parameter
// p and step s:
//   1. SubmitGrad      mark = s*4 + kMarkSubmitted; its norm phase then
//                      records the gradient's sum of squares
//   2. before updating hyper-parameters, clip coefficient and torch step
//                      into p's record, then
//                      mark = s*4 + kMarkUpdating (in clipping mode for every
//                      parameter of the step, then the step record's decision,
//                      before the first update of the step starts)
//   3. per sub-chunk   the kernel reads master and moments and writes the new
//                      values into the worker's journal slot, valid = 1, the
//                      slot copied into the state, then the chunk's progress
//   4. after the last  the manifest's torch step, then applied = s*2 + skipped;
//      chunk           only then PARAM_READY (a client never sees an update a
//                      crash could take back)
//   5. step end        the step record (the other of two copies, then the index)
// A restarted daemon adopting the segment (daemon/recovery/) copies in every
// whole redo record the progress has not passed, then rolls each parameter marked updating
// (in clipping mode: of a step whose decision is recorded) forward from its
// chunks' progress, with the same inputs through the same ApplyJournaled
// (optimizer/journaled_update.h, in journal slot 0): bit for bit what the dead
// daemon would have written, and a daemon killed while it recovers leaves
// state the next one recovers the same way. A parameter only submitted was
// not touched: its client posts it again. Stores are ordered with release; a
// SIGKILLed process loses no retired store.
#pragma once

#include <atomic>
#include <cstdint>

namespace trainstream::wire {

inline constexpr uint32_t kRecoveryMagic = 0x54535243;  // "TSRC"
// 4: the journal slots hold redo records (Note [Redo journal],
// daemon/optimizer/include/trainstream/optimizer/journaled_update.h).
inline constexpr uint32_t kRecoveryVersion = 4;
// A state whose gradients stream through a staging pool (grad_pool.h): each
// record's grad_offset names the pool extent its last submission read, so a
// daemon that knows only slots must not adopt it.
inline constexpr uint32_t kRecoveryVersionPooled = 5;
// Written before the redo journal: the journal slots hold undo records, whose
// meaning is the opposite (the slot is the old state). Refused by name.
inline constexpr uint32_t kRecoveryVersionUndo = 2;
inline constexpr uint32_t kRecoveryVersionUndoPooled = 3;
// Elements a worker updates between two progress records (the journal's unit).
inline constexpr uint64_t kSubChunkElems = 4096;

// RecoveryHeader::flags
inline constexpr uint32_t kRecoveryInitialized = 1;  // masters initialised: adoptable

// ParamRecord::mark phases: mark = step * 4 + phase.
inline constexpr uint64_t kMarkSubmitted = 1;
inline constexpr uint64_t kMarkUpdating = 2;

// What one STEP_DONE said, and the clipping decision of the step being applied.
struct StepRecord {
  uint64_t completed_step;  // last step whose every update landed (0: none)
  double completed_grad_norm;
  int32_t completed_status;  // CompletionStatus of its STEP_DONE
  uint32_t completed_params_updated;
  uint64_t decided_step;     // clipping mode: last step whose updates were decided
  float decided_scale;       // its clip coefficient (1: none)
  uint32_t decided_skipped;  // 1: that step is skipped whole (a non-finite norm)
  uint64_t reserved[3];
};
static_assert(sizeof(StepRecord) == 64, "wire format");

struct RecoveryHeader {
  uint32_t magic;    // kRecoveryMagic
  uint32_t version;  // kRecoveryVersion
  std::atomic<uint32_t> flags;
  uint32_t registration;     // index among its session's registrations (adoption order)
  uint8_t owner_proof[32];   // SHA-256 of the session's recovery token
  uint32_t owner_uid;        // the attaching client's
  int32_t owner_pid;         // the attaching client's process,
  uint64_t owner_start;      //   and its start time (/proc/<pid>/stat field 22)
  uint64_t chunk_elems;      // the engine's chunk: chunk c of a parameter starts at c * this
  uint64_t sub_chunk_elems;  // kSubChunkElems when written
  uint64_t records_offset;   // ParamRecord[entries], from the segment start
  uint64_t progress_offset;  // ChunkProgress[total_chunks]
  uint64_t total_chunks;
  uint64_t journal_offset;  // journal_slots slots of journal_slot_bytes each
  uint64_t journal_slot_bytes;
  uint32_t journal_slots;                     // one per worker of the daemon's pool
  std::atomic<uint32_t> current_step_record;  // which of step_records is whole (0 or 1)
  uint64_t staging_bytes;  // the registration's staging segment: its size and name
  char staging_name[64];
  double max_grad_norm;  // > 0: clipping mode (the step record's decision applies)
  uint32_t threads;      // the registration's worker-thread limit (0: the whole pool)
  // A data-parallel group's state: its local ranks (grad slots per parameter),
  // ranks in the whole job and machines; all 0 for a solo session's.
  uint32_t group_ranks;
  uint32_t world_size;
  uint32_t nnodes;
  // Version kRecoveryVersionPooled: the staging segment's gradient pool (else 0).
  uint64_t grad_pool_offset;
  uint64_t grad_pool_bytes;
  uint64_t reserved[2];
  StepRecord step_records[2];
};
static_assert(sizeof(RecoveryHeader) == 384, "wire format");

// One per parameter, in manifest order.
struct alignas(64) ParamRecord {
  std::atomic<uint64_t> mark;                  // step * 4 + phase of the engine's last submission
  std::atomic<uint64_t> applied;               // step * 2 + skipped of the last update that landed
  uint64_t state_step;                         // mark updating: the torch step the update produces
  double lr, beta1, beta2, eps, weight_decay;  // mark updating: the step's
  float grad_scale;                            // mark updating: clip coefficient
  uint32_t grad_dtype;                         // DType of the slot the engine reads
  double grad_sumsq;                           // of the marked step's gradient, once known
  uint64_t grad_offset;   // staging segment: the slot (or pool extent) the engine reads
  uint64_t param_offset;  // staging segment: the weights it writes
  uint64_t chunk_first;   // its ChunkProgress entries
  uint64_t chunks;
  // The client's gradient slots: local rank r's at rank_grad_offset + r *
  // rank_grad_stride (a solo session has one, the slot the engine reads).
  uint64_t rank_grad_offset;
  uint64_t rank_grad_stride;
  uint32_t rank_grad_dtype;
  uint32_t reserved0;
  uint64_t reserved[5];
};
static_assert(sizeof(ParamRecord) == 192, "wire format");

struct ChunkProgress {
  std::atomic<uint64_t> done_step;   // last step whose update of the chunk is whole
  std::atomic<uint64_t> done_elems;  // elements of the next update done (sub-chunk multiples)
};
static_assert(sizeof(ChunkProgress) == 16, "wire format");

// A journal slot: this header, then master fp32[sub_chunk_elems], exp_avg and
// exp_avg_sq moment dtype[sub_chunk_elems] (each 64-byte aligned).
struct alignas(64) JournalSlotHeader {
  std::atomic<uint64_t> valid;  // 1 once the copy below is whole
  uint64_t entry;               // manifest entry index
  uint64_t step;                // the update's (its mark's) step
  uint64_t offset;              // first element, of the parameter
  uint64_t count;
  uint64_t reserved[3];
};
static_assert(sizeof(JournalSlotHeader) == 64, "wire format");

// Where the three arrays of a journal slot lie, from the slot's start.
struct JournalSlotLayout {
  uint64_t master;
  uint64_t exp_avg;
  uint64_t exp_avg_sq;
  uint64_t bytes;  // the slot's size, a multiple of 64
};

inline JournalSlotLayout JournalSlotLayoutFor(uint64_t sub_chunk_elems, uint64_t moment_bytes) {
  auto align = [](uint64_t v) { return (v + 63) / 64 * 64; };
  JournalSlotLayout l{};
  l.master = sizeof(JournalSlotHeader);
  l.exp_avg = align(l.master + sub_chunk_elems * 4);
  l.exp_avg_sq = align(l.exp_avg + sub_chunk_elems * moment_bytes);
  l.bytes = align(l.exp_avg_sq + sub_chunk_elems * moment_bytes);
  return l;
}

}  // namespace trainstream::wire
