#include "trainstream/optimizer/journaled_update.h"

#include <algorithm>
#include <atomic>
#include <cstring>

namespace trainstream::optimizer {
namespace {

// Where a slot keeps each array of a sub-chunk, from the slot's start (Note
// [Journaling a master in two places]): the master (fp32, or a split master's high
// halves), a split master's low halves, the moments.
struct SlotArrays {
  uint64_t master;
  uint64_t master_lo;
  uint64_t exp_avg;
  uint64_t exp_avg_sq;
};

SlotArrays SlotArraysFor(kernels::DType moment_dtype) {
  const wire::JournalSlotLayout jl =
      wire::JournalSlotLayoutFor(wire::kSubChunkElems, kernels::DTypeSize(moment_dtype));
  return {jl.master, jl.master + wire::kSubChunkElems * 2, jl.exp_avg, jl.exp_avg_sq};
}

// Where the slot's copy of each array lies, and where the arrays are.
struct JournalCopy {
  char* state;           // elements [off, off + n) of one array
  uint64_t slot_offset;  // its copy, from the slot's start
  size_t bytes;
};

int JournalCopies(const kernels::AdamWRange& whole, size_t off, size_t n, JournalCopy out[4]) {
  const size_t mb = kernels::DTypeSize(whole.moment_dtype);
  const SlotArrays sa = SlotArraysFor(whole.moment_dtype);
  int k = 0;
  if (whole.master_lo != nullptr) {
    out[k++] = {static_cast<char*>(whole.param_out) + off * 2, sa.master, n * 2};
    out[k++] = {reinterpret_cast<char*>(whole.master_lo + off), sa.master_lo, n * 2};
  } else {
    out[k++] = {reinterpret_cast<char*>(whole.master + off), sa.master, n * 4};
  }
  out[k++] = {static_cast<char*>(whole.exp_avg) + off * mb, sa.exp_avg, n * mb};
  out[k++] = {static_cast<char*>(whole.exp_avg_sq) + off * mb, sa.exp_avg_sq, n * mb};
  return k;
}

}  // namespace

void CommitJournaled(const kernels::AdamWRange& whole, const char* slot, size_t off, size_t n) {
  JournalCopy copies[4];
  const int k = JournalCopies(whole, off, n, copies);
  for (int i = 0; i < k; ++i)
    std::memcpy(copies[i].state, slot + copies[i].slot_offset, copies[i].bytes);
}

void RecordProgress(wire::ChunkProgress* progress, uint64_t step, size_t done, size_t count) {
  if (done < count) {
    progress->done_elems.store(done, std::memory_order_release);
  } else {
    progress->done_step.store(step, std::memory_order_release);
    progress->done_elems.store(0, std::memory_order_release);
  }
}

void ApplyJournaled(const JournaledChunk& c, size_t done) {
  const kernels::AdamWRange& whole = c.whole;
  const SlotArrays sa = SlotArraysFor(whole.moment_dtype);
  char* slot = c.journal_slot;
  auto* jh = reinterpret_cast<wire::JournalSlotHeader*>(slot);
  while (done < c.chunk_count) {
    const size_t n = std::min<size_t>(wire::kSubChunkElems, c.chunk_count - done);
    const size_t off = c.chunk_offset + done;
    jh->valid.store(0, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_release);  // invalid before its copy changes
    // The step reads the state and writes the slot (and a weight that is not the
    // master, which the state's old master can always write again).
    const kernels::AdamWRange state = whole.Slice(off, n);
    kernels::AdamWRange r = state;
    r.from.exp_avg = state.exp_avg;
    r.from.exp_avg_sq = state.exp_avg_sq;
    r.exp_avg = slot + sa.exp_avg;
    r.exp_avg_sq = slot + sa.exp_avg_sq;
    if (state.master_lo != nullptr) {
      r.from.master_hi = static_cast<const uint16_t*>(state.param_out);
      r.from.master_lo = state.master_lo;
      r.param_out = slot + sa.master;
      r.master_lo = reinterpret_cast<uint16_t*>(slot + sa.master_lo);
    } else {
      r.from.master = state.master;
      r.master = reinterpret_cast<float*>(slot + sa.master);
      if (state.param_out == static_cast<void*>(state.master)) r.param_out = r.master;
    }
    kernels::RoundingKey key = c.key;
    key.element_offset = off;
    kernels::AdamWUpdate(r, c.scalars, key, c.isa);
    jh->entry = c.entry;
    jh->step = c.step;
    jh->offset = off;
    jh->count = n;
    jh->valid.store(1, std::memory_order_release);
    std::atomic_thread_fence(std::memory_order_release);  // valid before the state changes
    CommitJournaled(whole, slot, off, n);
    done += n;
    RecordProgress(c.progress, c.step, done, c.chunk_count);
  }
}

}  // namespace trainstream::optimizer
