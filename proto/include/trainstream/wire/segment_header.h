// The header at offset 0 of every segment the daemon creates. A state segment's
// header is followed by a manifest describing what it holds and a recovery
// header (state_record.h), so a restarted daemon can find and re-adopt
// optimizer state: Note [Optimizer state outlives the daemon].
#pragma once

#include <cstdint>

#include "trainstream/wire/dtype.h"
#include "trainstream/wire/segment_kind.h"

namespace trainstream::wire {

inline constexpr uint32_t kSegmentMagic = 0x54535347;  // "TSSG"
// 2: state segments carry a RecoveryHeader; 3: manifest entries name their MasterLayout
inline constexpr uint32_t kSegmentVersion = 3;
inline constexpr uint64_t kSegmentHeaderBytes = 4096;  // one page; data starts after

struct SegmentHeader {
  uint32_t magic;
  uint32_t version;
  uint32_t kind;  // SegmentKind (segment_kind.h; trainstream.v1.SegmentKind's numbers)
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

// Note [One host copy of a trained weight]
// The staging segment's weight slot (the parameter's dtype, what the client copies
// to the GPU) is part of the fp32 master wherever it can be, so a weight is held once:
//   fp32 weights   the fp32 weight slot is the master (nothing in the state segment);
//   bf16 weights   the bf16 slot is the master's high half, the state segment holds its
//                  low halves (Note [Split master], trainstream/kernels/bf16.h): 2 B a
//                  parameter instead of 4;
//   fp16 weights   an fp16 value is no part of an fp32 one (its exponent is narrower),
//                  so the state segment keeps a whole fp32 master, as before.
// Nothing rounds a weight stochastically (only bf16 moments are), so these are all
// the cases. The master is then partly in memory the client maps read-write: a
// client that writes its weight slot changes its own master (it could send any
// gradient anyway); the daemon only computes with what is there, and a slot's
// mapping is guarded like every client page (Note [Client pages can vanish]). A
// split master is an fp32 master's bits except after a tie that rounded up (about
// one element in 2^17 per step), which it keeps one ulp further from zero (Note
// [Split master]): bf16 weights train as with a whole fp32 master to the ulp of the
// master, not to the bit; fp32 and fp16 weights bit for bit.
enum class MasterLayout : uint32_t {
  kFp32 = 0,        // fp32[numel] at master_offset in the state segment
  kSplitBf16 = 1,   // high halves: the bf16 weight slot; low halves: uint16[numel] at master_offset
  kWeightSlot = 2,  // the fp32 weight slot itself; master_offset is 0
};

inline constexpr MasterLayout MasterLayoutFor(DType param_dtype) {
  return param_dtype == DType::kFloat32    ? MasterLayout::kWeightSlot
         : param_dtype == DType::kBFloat16 ? MasterLayout::kSplitBf16
                                           : MasterLayout::kFp32;
}

// Bytes per element a master of `layout` takes in the state segment.
inline constexpr uint64_t MasterStateBytes(MasterLayout layout) {
  return layout == MasterLayout::kFp32 ? 4 : layout == MasterLayout::kSplitBf16 ? 2 : 0;
}

struct StateManifestEntry {
  uint64_t param_id;
  uint64_t numel;
  uint32_t dtype;  // training dtype: DType (dtype.h)
  uint32_t group;
  uint64_t master_offset;      // MasterLayout's state array, from the segment start (0: none)
  uint64_t exp_avg_offset;     // moment_dtype[numel]
  uint64_t exp_avg_sq_offset;  // moment_dtype[numel]
  uint64_t step;               // torch's state['step'] after the last update that landed
  uint32_t master_layout;      // MasterLayout: where the master is
  uint32_t reserved0;
  char name[112];
};
static_assert(sizeof(StateManifestEntry) == 176, "wire format");

}  // namespace trainstream::wire
