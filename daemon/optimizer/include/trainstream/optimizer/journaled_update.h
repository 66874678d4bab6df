// The one way an update of durable state is applied, by the engine and by the
// roll-forward of a restarted daemon alike (Note [Optimizer state outlives the
// daemon], trainstream/wire/state_record.h): sub-chunk by sub-chunk, each one
// copied into a journal slot before the kernel changes it, the chunk's progress
// recorded after.
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

// Note [Journaling a master in two places]. A journal slot's master array
// (JournalSlotLayout::master, 4 bytes an element) holds what the master of
// the sub-chunk was wherever it lives (Note [One host copy of a trained
// weight], trainstream/wire/segment_header.h): the fp32 values (a state array
// or the fp32 weight slot), or for a split master the bf16 high halves (the
// weight slot) in its first kSubChunkElems * 2 bytes and the low halves after
// them. Restoring both halves puts back the master bit for bit, and with it
// the weight the client copies.

// Copies elements [off, off + n) of `whole`'s master and moments into, and
// back from, the journal slot `slot` (JournalSlotHeader first); n <= kSubChunkElems.
void SaveJournaled(const kernels::AdamWRange& whole, char* slot, size_t off, size_t n);
void RestoreJournaled(const kernels::AdamWRange& whole, const char* slot, size_t off, size_t n);

// Updates elements [chunk_offset + done, chunk_offset + chunk_count) where
// `done` is the chunk's recorded progress (0 for a new update), then records
// the chunk whole for `step`.
void ApplyJournaled(const JournaledChunk& c, size_t done);

}  // namespace trainstream::optimizer
