// The one place a RegisterParameters request becomes the optimizer plane's
// input (optimizer_plane.h): its options and one ParamBinding per parameter.
// SessionRegistry (a solo session) and GroupRegistry (a data-parallel group)
// both call it, so every option of the request reaches both kinds of plane.
#pragma once

#include <memory>

#include "planes/grad_pool.h"
#include "planes/optimizer_plane.h"
#include "sessions/param_layout.h"
#include "trainstream/v1/control.pb.h"

namespace trainstream::daemon {

struct PlaneRegistration {
  SessionOptimizerOptions options;
  std::vector<ParamBinding> params;    // request order
  std::unique_ptr<GradientPool> pool;  // the layout's gradient pool (null: slots)
};

// The plane's options from a validated request (moment dtype, clipping, seed,
// worker threads).
SessionOptimizerOptions OptimizerOptionsOf(const v1::RegisterParametersRequest& req);

// For validated `req` laid out as `layout` (ComputeRegistrationLayout) in a
// state segment mapped at `state_base` and a staging segment mapped at
// `staging_base` (each with its SegmentHeader first): writes the state
// manifest (WriteStateManifest, with `owner` in its recovery header when the
// layout has recovery records) and returns the plane's options and bindings.
// A layout with a sum slot (a group's) binds each local rank's grad slot and
// the sum slot; one with a gradient pool binds every parameter to the pool
// (written fresh, here); else the one grad slot. The pointers are into the two
// mappings: they live as long as those do.
PlaneRegistration BindRegistration(const v1::RegisterParametersRequest& req,
                                   const RegistrationLayout& layout, char* state_base,
                                   char* staging_base, const RecoveryOwner* owner = nullptr);

// Points b's master where `layout` keeps it (Note [One host copy of a trained
// weight], trainstream/wire/segment_header.h), its param_slot set first: a state
// array at `master_offset` of the state segment mapped at `state_base`, the
// param slot itself, or both halves.
void BindMaster(ParamBinding* b, wire::MasterLayout layout, char* state_base,
                uint64_t master_offset);

// The engine's records of manifest entry `index` of a state segment mapped at
// `state_base` whose recovery header is at `recovery_offset` (all null for 0);
// `entry_step_offset` is where that entry's torch step lies.
optimizer::DurableRecords DurableRecordsOf(char* state_base, uint64_t recovery_offset,
                                           uint64_t entry_step_offset, uint64_t index);

}  // namespace trainstream::daemon
