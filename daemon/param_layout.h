// Validation and memory layout of RegisterParameters (pure functions, no I/O).
//
// Staging segment (kind session, handed to the client):
//   [0, 4096)  SegmentHeader
//   per parameter, in request order: grad slot (numel * grad dtype size), then
//   param slot (numel * dtype size); every slot starts 64-byte aligned.
//   Slot offsets are from the start of the segment.
//
// State segment (kind state, daemon only; re-adoptable after a restart):
//   [0, 4096)  SegmentHeader (manifest_offset = 4096)
//   StateManifest, then one StateManifestEntry per parameter
//   per parameter (64-byte aligned, starting on the page after the manifest):
//   master fp32[numel], exp_avg moment[numel], exp_avg_sq moment[numel].
#pragma once

#include <grpcpp/support/status.h>

#include <cstdint>
#include <set>
#include <vector>

#include "trainstream/v1/control.pb.h"

namespace trainstream::daemon {

// Limits on what a client may ask for (bad input is refused, never trusted).
inline constexpr uint64_t kMaxParamNumel = 1ull << 36;  // 64 Gi elements per tensor
inline constexpr int kMaxParamDims = 16;
inline constexpr size_t kMaxParamsPerRequest = 1u << 20;
inline constexpr size_t kMaxGroups = 4096;

size_t DTypeBytes(int dtype);  // 0 for unknown / unspecified

// Checks `req` (except the session fields). `registered` holds the session's
// param ids so far. INVALID_ARGUMENT names the field, e.g. "params[3].shape[1]".
grpc::Status ValidateRegistration(const v1::RegisterParametersRequest& req,
                                  const std::set<uint64_t>& registered);

struct ParamPlacement {
  uint64_t numel = 0;
  uint64_t grad_offset = 0;    // staging segment
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
};

// Layout for a validated request.
RegistrationLayout ComputeRegistrationLayout(const v1::RegisterParametersRequest& req);

inline uint64_t AlignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

}  // namespace trainstream::daemon
