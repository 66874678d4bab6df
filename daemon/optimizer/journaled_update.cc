#include "trainstream/optimizer/journaled_update.h"

#include <algorithm>
#include <atomic>
#include <cstring>

namespace trainstream::optimizer {

void ApplyJournaled(const JournaledChunk& c, size_t done) {
  const kernels::AdamWRange& whole = c.whole;
  const size_t moment_bytes = kernels::DTypeSize(whole.moment_dtype);
  const wire::JournalSlotLayout jl = wire::JournalSlotLayoutFor(wire::kSubChunkElems, moment_bytes);
  auto* jh = reinterpret_cast<wire::JournalSlotHeader*>(c.journal_slot);
  while (done < c.chunk_count) {
    const size_t n = std::min<size_t>(wire::kSubChunkElems, c.chunk_count - done);
    const size_t off = c.chunk_offset + done;
    jh->valid.store(0, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_release);  // invalid before its copy changes
    std::memcpy(c.journal_slot + jl.master, whole.master + off, n * sizeof(float));
    std::memcpy(c.journal_slot + jl.exp_avg,
                static_cast<const char*>(whole.exp_avg) + off * moment_bytes, n * moment_bytes);
    std::memcpy(c.journal_slot + jl.exp_avg_sq,
                static_cast<const char*>(whole.exp_avg_sq) + off * moment_bytes, n * moment_bytes);
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
