#include "trainstream/optimizer/journaled_update.h"

#include <algorithm>
#include <atomic>
#include <cstring>

namespace trainstream::optimizer {
namespace {

// Where the slot's copy of each array lies, and where the arrays are: one
// table for both directions (Note [Journaling a master in two places]).
struct JournalCopy {
  char* state;           // elements [off, off + n) of one array
  uint64_t slot_offset;  // its copy, from the slot's start
  size_t bytes;
};

int JournalCopies(const kernels::AdamWRange& whole, size_t off, size_t n, JournalCopy out[4]) {
  const size_t mb = kernels::DTypeSize(whole.moment_dtype);
  const wire::JournalSlotLayout jl = wire::JournalSlotLayoutFor(wire::kSubChunkElems, mb);
  int k = 0;
  if (whole.master_lo != nullptr) {
    out[k++] = {static_cast<char*>(whole.param_out) + off * 2, jl.master, n * 2};
    out[k++] = {reinterpret_cast<char*>(whole.master_lo + off),
                jl.master + wire::kSubChunkElems * 2, n * 2};
  } else {
    out[k++] = {reinterpret_cast<char*>(whole.master + off), jl.master, n * 4};
  }
  out[k++] = {static_cast<char*>(whole.exp_avg) + off * mb, jl.exp_avg, n * mb};
  out[k++] = {static_cast<char*>(whole.exp_avg_sq) + off * mb, jl.exp_avg_sq, n * mb};
  return k;
}

}  // namespace

void SaveJournaled(const kernels::AdamWRange& whole, char* slot, size_t off, size_t n) {
  JournalCopy copies[4];
  const int k = JournalCopies(whole, off, n, copies);
  for (int i = 0; i < k; ++i)
    std::memcpy(slot + copies[i].slot_offset, copies[i].state, copies[i].bytes);
}

void RestoreJournaled(const kernels::AdamWRange& whole, const char* slot, size_t off, size_t n) {
  JournalCopy copies[4];
  const int k = JournalCopies(whole, off, n, copies);
  for (int i = 0; i < k; ++i)
    std::memcpy(copies[i].state, slot + copies[i].slot_offset, copies[i].bytes);
}

void ApplyJournaled(const JournaledChunk& c, size_t done) {
  const kernels::AdamWRange& whole = c.whole;
  auto* jh = reinterpret_cast<wire::JournalSlotHeader*>(c.journal_slot);
  while (done < c.chunk_count) {
    const size_t n = std::min<size_t>(wire::kSubChunkElems, c.chunk_count - done);
    const size_t off = c.chunk_offset + done;
    jh->valid.store(0, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_release);  // invalid before its copy changes
    SaveJournaled(whole, c.journal_slot, off, n);
    jh->entry = c.entry;
    jh->step = c.step;
    jh->offset = off;
    jh->count = n;
    jh->valid.store(1, std::memory_order_release);
    std::atomic_thread_fence(std::memory_order_release);  // valid before the state changes
    kernels::RoundingKey key = c.key;
    key.element_offset = off;
    kernels::AdamWUpdate(whole.Slice(off, n), c.scalars, key, c.isa);
    done += n;
    if (done < c.chunk_count) {
      c.progress->done_elems.store(done, std::memory_order_release);
    } else {
      c.progress->done_step.store(c.step, std::memory_order_release);
      c.progress->done_elems.store(0, std::memory_order_release);
    }
  }
}

}  // namespace trainstream::optimizer
