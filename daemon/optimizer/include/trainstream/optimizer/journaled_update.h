// The one way an update of durable state is applied, by the engine and by the
// roll-forward of a restarted daemon alike (Note [Optimizer state outlives the
// daemon], trainstream/wire/state_record.h): sub-chunk by sub-chunk, each one
// computed into a journal slot, then copied into the state, the chunk's progress
// recorded after (Note [Redo journal]).
#pragma once

#include <cstddef>
#include <cstdint>

#include "trainstream/kernels/adamw.h"
#include "trainstream/wire/state_record.h"

namespace trainstream::optimizer {

struct JournaledChunk {
  kernels::AdamWRange whole;  // the parameter's arrays (every pointer at element 0)
  kernels::AdamWStepScalars scalars{};
  kernels::RoundingKey key;  // element_offset ignored: set per sub-chunk
  kernels::Isa isa = kernels::Isa::kScalar;
  uint64_t entry = 0;       // the parameter's manifest index and the update's step,
  uint64_t step = 0;        //   as the journal names them
  size_t chunk_offset = 0;  // the chunk's first element and its length
  size_t chunk_count = 0;
  char* journal_slot = nullptr;  // one slot (JournalSlotHeader first), used by nobody else now
  wire::ChunkProgress* progress = nullptr;
};

// Note [Redo journal]. Each sub-chunk's update is computed out of place: the
// kernel reads the old master and moments from the state and writes the new ones
// into the worker's journal slot (AdamWRange::from), the slot is marked valid, its
// contents are copied into the state, and only then does the chunk's progress move
// past it. A daemon killed before `valid` left the state untouched (bar a weight
// that is not the master, which the next attempt writes again from the same old
// master); one killed after it left a whole redo record, which recovery copies in
// again (the copy is idempotent) before it records the progress. The slot is
// written while the state's lines are on their way in from DRAM and read back from
// cache, so the journal costs one cache-to-cache copy per sub-chunk: an undo
// journal (copy the old state out first, then update in place) read the state
// before the kernel could, serialising the two, and cost 28-40% of the update
// (docs/staging-pool.md, "The journal").
//
// Note [Journaling a master in two places]. A journal slot's master array
// (JournalSlotLayout::master, 4 bytes an element) holds the master of the
// sub-chunk in the form it lives in (Note [One host copy of a trained weight],
// trainstream/wire/segment_header.h): fp32 values (for a state array or the fp32
// weight slot), or for a split master the bf16 high halves (the weight slot) in
// its first kSubChunkElems * 2 bytes and the low halves after them. Copying both
// halves in puts the master in place bit for bit, and with it the weight the
// client copies.

// Copies the slot `slot` (JournalSlotHeader first) into elements [off, off + n) of
// `whole`'s master and moments; n <= kSubChunkElems.
void CommitJournaled(const kernels::AdamWRange& whole, const char* slot, size_t off, size_t n);

// Records that `done` of the chunk's `count` elements are updated for `step`
// (the chunk whole when done == count).
void RecordProgress(wire::ChunkProgress* progress, uint64_t step, size_t done, size_t count);

// Updates elements [chunk_offset + done, chunk_offset + chunk_count) where
// `done` is the chunk's recorded progress (0 for a new update), then records
// the chunk whole for `step`.
void ApplyJournaled(const JournaledChunk& c, size_t done);

}  // namespace trainstream::optimizer
