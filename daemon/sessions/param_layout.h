// Validation and memory layout of RegisterParameters (pure functions, no I/O).
//
// Staging segment (kind session, handed to the client):
//   [0, 4096)  SegmentHeader
//   per parameter, in request order: grad slot (numel * grad dtype size), then
//   param slot (numel * dtype size); every slot starts 64-byte aligned.
//   A data-parallel group's staging (one segment every local rank maps) has,
//   per parameter: one grad slot per local rank (grad_offset + r * grad_stride),
//   an fp32 sum slot, then the one param slot all ranks copy from.
//   Slot offsets are from the start of the segment.
//
// State segment (kind state, daemon only; re-adoptable after a restart):
//   [0, 4096)  SegmentHeader (manifest_offset = 4096)
//   StateManifest, then one StateManifestEntry per parameter
//   per parameter (64-byte aligned, starting on the page after the manifest):
//   master fp32[numel], exp_avg moment[numel], exp_avg_sq moment[numel].
#pragma once

#include <cstdint>
#include <set>
#include <vector>

#include "trainstream/status.h"
#include "trainstream/v1/control.pb.h"
#include "trainstream/wire/segment_header.h"

namespace trainstream::daemon {

// Limits on what a client may ask for (bad input is refused, never trusted).
inline constexpr uint64_t kMaxParamNumel = 1ull << 36;  // 64 Gi elements per tensor
inline constexpr int kMaxParamDims = 16;
inline constexpr size_t kMaxParamsPerRequest = 1u << 20;
// Elements of all parameters of one request together (1 Ti): keeps every offset
// ComputeRegistrationLayout adds up (64 gradient slots, a sum slot, the weights)
// far below 2^64.
inline constexpr uint64_t kMaxRequestNumel = 1ull << 40;
inline constexpr size_t kMaxGroups = 4096;

size_t DTypeBytes(int dtype);  // 0 for unknown / unspecified

// Checks `req` (except the session fields). `registered` holds the session's
// param ids so far. INVALID_ARGUMENT names the field, e.g. "params[3].shape[1]".
Status ValidateRegistration(const v1::RegisterParametersRequest& req,
                            const std::set<uint64_t>& registered);

struct ParamPlacement {
  uint64_t numel = 0;
  uint64_t grad_offset = 0;    // staging segment (local rank 0's in a group)
  uint64_t grad_stride = 0;    // bytes between consecutive ranks' grad slots
  uint64_t sum_offset = 0;     // group staging only: fp32[numel]; else 0
  uint64_t param_offset = 0;   // staging segment
  uint64_t master_offset = 0;  // state segment
  uint64_t exp_avg_offset = 0;
  uint64_t exp_avg_sq_offset = 0;
};

struct RegistrationLayout {
  std::vector<ParamPlacement> params;  // request order
  uint64_t staging_bytes = 0;          // total staging segment size (page multiple)
  uint64_t state_bytes = 0;            // total state segment size (page multiple)
  uint64_t manifest_offset = 0;
  uint64_t manifest_bytes = 0;
  uint32_t grad_slots = 1;  // per parameter: a group's local world size, else 1
  bool sum_slot = false;    // per parameter: an fp32 sum slot (groups)
};

// Layout for a validated request. A group's staging has `grad_slots` (its
// local world size) gradient slots and a sum slot per parameter.
RegistrationLayout ComputeRegistrationLayout(const v1::RegisterParametersRequest& req,
                                             uint32_t grad_slots = 1, bool sum_slot = false);

// Writes the manifest of a state segment mapped at `state_base` (its
// SegmentHeader first) for `req` laid out as `layout`. Returns the entries, one
// per parameter in request order; their `step` is kept current by the optimizer.
wire::StateManifestEntry* WriteStateManifest(char* state_base, const RegistrationLayout& layout,
                                             const v1::RegisterParametersRequest& req);

inline uint64_t AlignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

}  // namespace trainstream::daemon
