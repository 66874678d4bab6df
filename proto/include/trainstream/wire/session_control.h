// The session control region: what a client and the daemon share for one
// session's data plane. Created by the daemon at attach, mapped read-write by the
// client. Layout (offsets in the header, every part 64-byte aligned):
//
//   SessionControlHeader
//   command ring     client -> daemon   CommandRecord   (GRAD_READY, STEP_END, ...)
//   completion ring  daemon -> client   CompletionRecord (PARAM_READY, STEP_DONE, ...)
//
// Both rings are single-producer/single-consumer (ring.h). A client that posts
// from several threads serialises its own posts.
#pragma once

#include <atomic>
#include <cstdint>
#include <new>

#include "trainstream/wire/ring.h"

namespace trainstream::wire {

inline constexpr uint32_t kSessionControlMagic = 0x54534354;  // "TSCT"
inline constexpr uint32_t kSessionControlVersion = 1;

struct alignas(64) SessionControlHeader {
  uint32_t magic;
  uint32_t version;
  uint64_t session_id;
  uint64_t command_ring_offset;     // from the start of this header
  uint64_t completion_ring_offset;  // from the start of this header
  uint64_t total_bytes;
  // Set to 1 by the daemon when it is shutting down or the session is being torn
  // down; a client blocked on the completion ring re-checks it after each wake.
  std::atomic<uint32_t> closing;
  uint32_t reserved0;
  uint64_t reserved[2];
};
static_assert(sizeof(SessionControlHeader) == 64, "wire format");

enum class Opcode : uint32_t {
  kNone = 0,
  // client -> daemon
  kGradReady = 1,    // param_id's gradient is in its grad slot for `step`
  kStepEnd = 2,      // every gradient of `step` has been posted
  kLoadState = 3,    // copy a state tensor from a region into the daemon (see StateField)
  kExportState = 4,  // copy a state tensor from the daemon into a region
  kSync = 5,         // completes once every earlier command has completed
  kGradReduced = 6,  // group, local rank 0, nnodes > 1: param_id's sum slot is all-reduced
  // daemon -> client
  kParamReady = 16,  // param_id's new weights are in its param slot
  kStepDone = 17,    // the step finished (status, grad norm, skipped)
  kStateDone = 18,   // a kLoadState/kExportState finished
  kSyncDone = 19,
  kError = 20,  // a command was rejected; message says why
  // Group, to local rank 0 when nnodes > 1: the machine's summed gradient of
  // param_id for `step` is in its sum slot; all-reduce it, then post kGradReduced.
  kReduceReady = 21,
  // Group: the group cannot continue (a rank left, or ranks disagreed); message
  // says which rank and why. Every later command of the session is answered so.
  kGroupBroken = 22,
};

// Which tensor of a parameter's optimizer state a kLoadState/kExportState moves.
enum class StateField : uint32_t {
  kMaster = 0,         // fp32 master weights
  kExpAvg = 1,         // first moment, as fp32 on the wire
  kExpAvgSq = 2,       // second moment, as fp32 on the wire
  kStep = 3,           // the step count (in `step`, no payload)
  kParamFromSlot = 4,  // master := the param slot's contents (initialisation)
  // Load only: weights written from outside the engine become the master's value
  // (AdamWEngine::AdoptWeights, Note [Weights written from outside the engine]). The
  // payload is numel elements of the parameter's dtype; bytes 0: its slot holds them.
  kWeights = 5,
};

// Flags on kGradReady / kStepEnd.
inline constexpr uint32_t kFlagNone = 0;

struct alignas(64) CommandRecord {
  Opcode opcode;
  uint32_t flags;
  uint64_t seq;       // client-assigned, increasing; echoed in the completion
  uint64_t param_id;  // kGradReady, kLoadState, kExportState
  uint64_t step;      // 1-based optimizer step this command belongs to
  // Hyper-parameters in force for this parameter at this step: the lr (and the
  // rest) arrive with each step, so schedulers and group edits just work.
  double lr;
  double beta1;
  double beta2;
  double eps;
  double weight_decay;
  // kLoadState / kExportState: which field, and where its payload lives.
  StateField field;
  uint32_t reserved0;
  uint64_t region_id;      // a region of this session (AllocateRegion)
  uint64_t region_offset;  // byte offset inside that region
  uint64_t bytes;          // payload bytes
  // kStepEnd: number of kGradReady records of this step (a cross-check).
  uint64_t grads_posted;
  uint64_t reserved[1];
};
static_assert(sizeof(CommandRecord) == 128, "wire format");

enum class CompletionStatus : int32_t {
  kOk = 0,
  kSkippedNonFinite = 1,  // a gradient was NaN/Inf: the step was not applied
  kInvalid = 2,           // bad command (unknown param id, bad region, ...)
  kInternal = 3,
};

struct alignas(64) CompletionRecord {
  Opcode opcode;
  CompletionStatus status;
  uint64_t seq;  // of the command this answers
  uint64_t param_id;
  uint64_t step;
  double grad_norm;         // kStepDone: global L2 norm of the gradients before clipping
  uint64_t params_updated;  // kStepDone
  char message[80];         // NUL-terminated; empty when status is kOk
};
static_assert(sizeof(CompletionRecord) == 128, "wire format");

// Where the parts of a control region with rings of `capacity` records lie,
// from the start of the region (the SessionControlHeader).
struct ControlLayout {
  uint64_t command_ring_offset;
  uint64_t completion_ring_offset;
  uint64_t bytes;  // the smallest region that holds it, a whole number of pages
};

inline ControlLayout ControlLayoutFor(uint64_t capacity) {
  auto align = [](uint64_t v, uint64_t a) { return (v + a - 1) / a * a; };
  ControlLayout l{};
  l.command_ring_offset = align(sizeof(SessionControlHeader), 64);
  l.completion_ring_offset =
      align(l.command_ring_offset + RingBytes(capacity, sizeof(CommandRecord)), 64);
  l.bytes = align(l.completion_ring_offset + RingBytes(capacity, sizeof(CompletionRecord)), 4096);
  return l;
}

// Lays out a fresh control region at `base` (the daemon, once, at attach):
// the header, then both rings, empty. `bytes` is the region's length.
inline ControlLayout InitializeControlRegion(void* base, uint64_t session_id, uint64_t bytes,
                                             uint64_t capacity) {
  const ControlLayout l = ControlLayoutFor(capacity);
  auto* h = new (base) SessionControlHeader();
  h->magic = kSessionControlMagic;
  h->version = kSessionControlVersion;
  h->session_id = session_id;
  h->command_ring_offset = l.command_ring_offset;
  h->completion_ring_offset = l.completion_ring_offset;
  h->total_bytes = bytes;
  h->closing.store(0);
  char* p = static_cast<char*>(base);
  RingView::Initialize(p + l.command_ring_offset, capacity, sizeof(CommandRecord));
  RingView::Initialize(p + l.completion_ring_offset, capacity, sizeof(CompletionRecord));
  return l;
}

}  // namespace trainstream::wire
