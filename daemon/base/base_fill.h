// FillBase: writes a planned base (base_loader.h) into its segment, reading the
// checkpoint on several threads.
//
// The tensors are cut into pieces of at most FillOptions::piece_bytes checkpoint
// bytes (a quantized tensor at block boundaries), listed in checkpoint order, and
// `threads` loader threads take them in that order. Every piece's destination was
// fixed by PlanBase from the headers, so threads never share a buffer:
//   - a piece of an unquantized tensor is read with pread straight to its final
//     offset in the segment;
//   - a piece of a quantized tensor is read into the thread's own scratch, checked
//     for non-finite values, and quantized by the CPU kernels (QuantizeBlockRangeCpu,
//     one thread) into that piece's codes and scales. nvfp4 needs the whole tensor's
//     absmax first: its tensors are read twice, a pass of pieces that only take the
//     absmax, then the quantizing pass (which waits until the first is complete).
// While one thread quantizes, the others read: reading and quantizing overlap. The
// bytes do not depend on the threads or the piece size (kernels/quant.h: blocks are
// independent), so a load with 1 thread and with N gives the same segment.
//
// Memory: each thread's scratch holds one piece (plus its fp32 copy for an F16
// source): FillScratchBytes(plan, options) in all, which the caller reserves from
// the budget before FillBase allocates it. Unquantized loads use none.
//
// Once a tensor's last piece is written its checkpoint pages are dropped from the
// page cache (POSIX_FADV_DONTNEED): a 30 GB checkpoint does not evict everyone
// else's cache.
//
// Errors name the file and the tensor. When several pieces fail, the one that comes
// first in the checkpoint is reported (what a one-thread load reports), e.g. the
// first non-finite element of a tensor. Cancellation: the calling thread calls
// `progress` about every 10 ms while the loader threads work, and after the last
// piece; once it returns false every thread stops before its next piece (so within
// one piece) and FillBase returns CANCELLED with kLoadCancelled. `progress` is only
// ever called on the calling thread.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "base/base_loader.h"
#include "base/model_sources.h"
#include "trainstream/status.h"

namespace trainstream::daemon::base {

// Checkpoint bytes per piece: large enough that a read is one syscall among
// hundreds of microseconds of copying, small enough that a thread's scratch stays
// in its core's L2 (2 MiB on the GPU host's cores) between the read and the
// quantize, and a cancelled load stops within a millisecond or so. On the 2-core
// machine, 14B-wide tensors to NF4 on 2 threads: 1 and 4 MiB pieces ran about
// alike, 16 MiB ones 1.5-2x slower.
inline constexpr uint64_t kLoadPieceBytes = 1ull << 20;

struct FillOptions {
  unsigned threads = 1;  // loader threads; 0 counts as 1. Never more than the pieces.
  uint64_t piece_bytes = kLoadPieceBytes;  // 0 takes kLoadPieceBytes (tests: small)
};

struct FillStats {
  unsigned threads = 0;             // threads that ran
  uint64_t scratch_peak_bytes = 0;  // scratch allocated, all threads together
  uint64_t pieces = 0;              // pieces the tensors were cut into
  uint64_t pieces_done = 0;         // pieces finished (fewer when stopped)
};

// The threads FillBase runs for `plan` with `options` (>= 1).
unsigned FillThreads(const BasePlan& plan, const FillOptions& options);

// The most scratch FillBase allocates for `plan` with `options`, all threads
// together: FillThreads x (the largest piece of a quantized tensor, plus its fp32
// copy for F16). 0 when nothing is quantized.
uint64_t FillScratchBytes(const BasePlan& plan, const FillOptions& options);

// Writes the manifest and every tensor into `segment` (plan.total_bytes long,
// SegmentHeader already written). See the header comment for `progress`.
Status FillBase(const ModelSources& sources, const BasePlan& plan, const std::string& key,
                char* segment, const FillOptions& options,
                const std::function<bool(const LoadProgress&)>& progress, FillStats* stats);

}  // namespace trainstream::daemon::base
