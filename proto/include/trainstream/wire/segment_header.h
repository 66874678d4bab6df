// The header at offset 0 of every segment the daemon creates. A state segment's
// header is followed by a manifest describing what it holds and a recovery
// header (state_record.h), so a restarted daemon can find and re-adopt
// optimizer state: Note [Optimizer state outlives the daemon].
#pragma once

#include <cstdint>

namespace trainstream::wire {

inline constexpr uint32_t kSegmentMagic = 0x54535347;  // "TSSG"
inline constexpr uint32_t kSegmentVersion = 2;  // 2: state segments carry a RecoveryHeader
inline constexpr uint64_t kSegmentHeaderBytes = 4096;  // one page; data starts after

struct SegmentHeader {
  uint32_t magic;
  uint32_t version;
  uint32_t kind;  // trainstream.v1.SegmentKind
  uint32_t flags;
  uint64_t total_bytes;  // the file's size
  uint64_t session_id;   // owner, 0 for daemon-owned (bases)
  uint32_t owner_uid;
  uint32_t reserved0;
  int64_t created_unix_ns;
  char job[64];  // NUL-terminated job name of the owner
  int32_t rank;
  int32_t local_rank;
  uint64_t manifest_offset;  // state segments: StateManifest location, else 0
  uint64_t manifest_bytes;
  uint8_t reserved[3960];  // pads the header to exactly kSegmentHeaderBytes
};
static_assert(sizeof(SegmentHeader) == kSegmentHeaderBytes, "wire format");

// State segments: one entry per parameter, after a StateManifest header.
struct StateManifest {
  uint32_t magic;  // kSegmentMagic
  uint32_t entries;
  uint32_t moment_dtype;  // DType (dtype.h; the same numbers as trainstream.v1.DType)
  uint32_t reserved0;
  uint64_t step;  // last step whose every update landed (the step record's, kept current)
  uint64_t seed;
  uint64_t recovery_offset;  // RecoveryHeader (state_record.h), from the segment start
};

struct StateManifestEntry {
  uint64_t param_id;
  uint64_t numel;
  uint32_t dtype;  // training dtype: DType (dtype.h)
  uint32_t group;
  uint64_t master_offset;      // fp32[numel], from the segment start
  uint64_t exp_avg_offset;     // moment_dtype[numel]
  uint64_t exp_avg_sq_offset;  // moment_dtype[numel]
  uint64_t step;               // torch's state['step'] after the last update that landed
  char name[120];
};
static_assert(sizeof(StateManifestEntry) == 176, "wire format");

}  // namespace trainstream::wire
