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
//   With a gradient staging pool (a solo session without clipping that asked
//   for one, trainstream/wire/grad_pool.h): [4096, 8192) its GradPoolHeader,
//   then the pool at 8192, then only param slots (grad_offset 0).
//
// State segment (kind state, daemon only; re-adoptable after a restart):
//   [0, 4096)  SegmentHeader (manifest_offset = 4096)
//   StateManifest, then one StateManifestEntry per parameter
//   with recovery (Note [Optimizer state outlives the daemon],
//   trainstream/wire/state_record.h), each 64-byte aligned: RecoveryHeader,
//   ParamRecord per parameter, ChunkProgress per chunk of every parameter,
//   one journal slot per worker of the pool
//   per parameter (64-byte aligned, starting on the page after the above): its
//   master's state array (MasterLayoutFor its dtype, Note [One host copy of a
//   trained weight] in trainstream/wire/segment_header.h: fp32[numel] for fp16
//   weights, the uint16[numel] low halves for bf16, none for fp32), then
//   exp_avg moment[numel], exp_avg_sq moment[numel].
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "trainstream/platform/user.h"
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
inline constexpr uint64_t kMaxGradPoolBytes = 1ull << 42;

size_t DTypeBytes(int dtype);  // 0 for unknown / unspecified
// The request's moment dtype and a parameter's gradient dtype, unspecified
// taken as fp32 and as the parameter's dtype.
int MomentDType(const v1::RegisterParametersRequest& req);
int GradDType(const v1::ParameterSpec& p);

// Checks `req` (except the session fields). `registered` holds the session's
// param ids so far. INVALID_ARGUMENT names the field, e.g. "params[3].shape[1]".
Status ValidateRegistration(const v1::RegisterParametersRequest& req,
                            const std::set<uint64_t>& registered);

struct ParamPlacement {
  uint64_t numel = 0;
  uint64_t chunk_first = 0;  // with recovery: its first ChunkProgress, and how many
  uint64_t chunks = 0;
  uint64_t grad_offset = 0;   // staging segment (local rank 0's in a group)
  uint64_t grad_stride = 0;   // bytes between consecutive ranks' grad slots
  uint64_t sum_offset = 0;    // group staging only: fp32[numel]; else 0
  uint64_t param_offset = 0;  // staging segment
  wire::MasterLayout master_layout = wire::MasterLayout::kFp32;
  uint64_t master_offset = 0;  // state segment: the master's state array (0: none)
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
  // A gradient staging pool instead of grad slots (0 bytes: none): the
  // request's grad_pool_bytes rounded up to the largest 64-byte-aligned
  // gradient and to a page.
  uint64_t grad_pool_offset = 0;
  uint64_t grad_pool_bytes = 0;
  // With recovery (RecoveryLayoutOptions::enabled), else all 0.
  uint64_t recovery_offset = 0;
  uint64_t records_offset = 0;
  uint64_t progress_offset = 0;
  uint64_t total_chunks = 0;
  uint64_t journal_offset = 0;
  uint64_t journal_slot_bytes = 0;
  uint32_t journal_slots = 0;
  uint64_t chunk_elems = 0;
};

// Whether a state segment carries recovery records, and what sizes them.
struct RecoveryLayoutOptions {
  bool enabled = false;        // recovery_grace > 0
  uint64_t chunk_elems = 0;    // the engine's chunk (kPlaneChunkElems)
  uint32_t journal_slots = 0;  // the optimizer pool's workers
};

// Who a state segment's recovery header names as its owner (docs/recovery.md).
struct RecoveryOwner {
  uint8_t proof[32] = {};  // SHA-256 of the recovery token
  platform::UserId uid = 0;
  pid_t pid = 0;
  uint64_t start = 0;         // the process's start time (ProcessStartTime)
  uint32_t registration = 0;  // its index among the session's registrations
  std::string staging_name;   // the registration's staging segment
  uint64_t staging_bytes = 0;
  uint32_t world_size = 0;  // a data-parallel group's: ranks of the job, machines
  uint32_t nnodes = 0;
};

// Layout for a validated request. A group's staging has `grad_slots` (its
// local world size) gradient slots and a sum slot per parameter; a solo one
// (grad_slots 1, no sum slot) has a gradient pool when the request asks for
// one (ValidateRegistration refuses one with clipping; groups refuse it).
RegistrationLayout ComputeRegistrationLayout(const v1::RegisterParametersRequest& req,
                                             uint32_t grad_slots = 1, bool sum_slot = false,
                                             const RecoveryLayoutOptions& recovery = {});

// Writes the manifest of a state segment mapped at `state_base` (its
// SegmentHeader first) for `req` laid out as `layout`, and, when the layout has
// recovery records, the recovery header naming `owner` (not null then) and each
// parameter's static record fields. Returns the entries, one per parameter in
// request order; their `step` is kept current by the optimizer.
wire::StateManifestEntry* WriteStateManifest(char* state_base, const RegistrationLayout& layout,
                                             const v1::RegisterParametersRequest& req,
                                             const RecoveryOwner* owner = nullptr);

inline uint64_t AlignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

}  // namespace trainstream::daemon
