// The optimizer plane's helpers (optimizer_plane.cc): dtype mapping, completion
// messages, a group's gradient sum, and moving one field of a parameter's optimizer state between
// the AdamW engine and a client region (kLoadState / kExportState).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "planes/optimizer_plane.h"
#include "trainstream/optimizer/adamw_engine.h"
#include "trainstream/wire/session_control.h"

namespace trainstream::daemon {

// dst[i] = (sum over r of srcs[r][i]) / divisor for i in [0, n): a group's
// gradients (dtype[n] each) into its fp32 sum slot. Large sums are split over
// `pool`'s workers; returns when all is summed.
void SumRankGradients(const std::vector<void*>& srcs, kernels::DType dtype, float* dst, size_t n,
                      float divisor, optimizer::WorkerPool* pool);

// Copies `message` into rec->message, truncated and NUL-terminated.
void SetCompletionMessage(wire::CompletionRecord* rec, const std::string& message);

// kParamFromSlot is not handled by MoveOptimizerState: initialisation is the
// plane's (local rank 0 triggers it).

// Applies `cmd` (field kMaster, kExpAvg, kExpAvgSq or kStep, load or export; kWeights,
// load only)
// to `engine`, which must be idle. `resolver` maps the command's region of the
// issuing session. On export of kStep, *step_out receives the step. When state
// was imported, *imported is set and *imported_step holds the parameter's new
// step, so the caller can update the manifest. Returns OK or an error naming
// what is wrong: NOT_FOUND (unknown param_id), else INVALID_ARGUMENT.
Status MoveOptimizerState(optimizer::AdamWEngine& engine, const wire::CommandRecord& cmd,
                          const RegionResolver& resolver, uint64_t* step_out, bool* imported,
                          uint64_t* imported_step);

}  // namespace trainstream::daemon
