// OptimizerPlane: the daemon's optimizer data plane. One plane serves the
// command rings of N members with one AdamW engine (daemon/optimizer/) holding
// one optimizer state, and answers on each member's completion ring. The
// session layer owns all memory; the plane only borrows pointers until Stop().
//
// Two kinds of plane, one class, both owned by OptimizerService:
//   solo    one session: a group of one whose gradient slot
//           the engine reads directly (no copy, no sum). Parameters may be
//           added by several RegisterParameters calls. A command the plane
//           cannot apply is answered with ERROR and the session goes on.
//   group   the ranks of one data-parallel group on this machine
//           (GroupRegistry; docs/data-parallel.md), even a group of one local
//           rank. Per parameter and step:
//     1. each local rank copies its gradient into its own grad slot and posts
//        GRAD_READY on its ring;
//     2. once every local rank has, the plane sums the slots into the fp32 sum
//        slot and divides by the job's world size (DDP's mean);
//     3. with several machines (nnodes > 1) it posts REDUCE_READY to local
//        rank 0, which all-reduces the sum slot across machines with
//        torch.distributed and answers GRAD_REDUCED;
//     4. the engine updates the parameter once and writes the new weights into
//        the one param slot every member maps; PARAM_READY goes to every member.
//   STEP_END is applied once every local rank has posted it. Clipping uses the
//   global norm of the summed gradients (the engine only ever sees those).
//
//   Why slots are never overwritten while in use: a rank posts step s+1's
//   gradient only after its step s finished (it copied every new weight), and
//   the update of step s+1 waits for every rank's gradient, so no rank can
//   still be reading a param slot, and no sum slot is still being read, when it
//   is rewritten.
//
//   Ranks that disagree (different steps, hyper-parameters, or sets of
//   parameters with gradients), and a command the engine refuses, make the
//   group fail: every member receives GROUP_BROKEN naming the rank and what
//   differs, and every later command that a client waits on is answered the
//   same way. A client's mistake never wedges the daemon.
//
// A member that breaks the wire rules (client_rings.h) is reported through
// SessionFaultFn with its session id; its rings are never touched again.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "planes/client_rings.h"
#include "planes/grad_pool.h"
#include "trainstream/optimizer/adamw_engine.h"
#include "trainstream/status.h"
#include "trainstream/wire/dtype.h"

namespace trainstream::optimizer {
class WorkerPool;
}

namespace trainstream::daemon {

// One registered parameter, with every pointer it needs (all owned by the
// session layer, valid until the plane is stopped).
struct ParamBinding {
  uint64_t param_id = 0;
  std::string name;
  uint64_t numel = 0;
  uint32_t group = 0;
  wire::DType param_dtype = wire::DType::kFloat32;
  wire::DType grad_dtype = wire::DType::kFloat32;
  // The fp32 master (Note [One host copy of a trained weight]): master, in the
  // state segment (fp16 weights), or param_slot itself (fp32 weights), or, with
  // master null, the bf16 param_slot plus these low halves in the state segment.
  float* master = nullptr;
  uint16_t* master_lo = nullptr;
  void* exp_avg = nullptr;     // moment dtype[numel], state segment
  void* exp_avg_sq = nullptr;  // moment dtype[numel], state segment
  void* grad_slot = nullptr;   // grad dtype[numel], staging (solo planes only)
  // Solo planes: the registration's gradient staging pool (grad_slot null); its
  // GRAD_READYs name extents (Note [A pool extent a client names]).
  GradientPool* pool = nullptr;
  void* param_slot = nullptr;  // param dtype[numel], staging segment
  // Where the engine keeps this parameter's commit records (Note [Optimizer
  // state outlives the daemon]); all null without recovery.
  optimizer::DurableRecords durable;
  // Group planes only: local rank r's gradient slot (grad dtype[numel]) is
  // rank_grads[r], and the engine reads the fp32 sum slot. Solo: empty, null.
  std::vector<void*> rank_grads;
  float* sum_slot = nullptr;
};

// The engine's chunk in every plane: a state segment's chunk progress records
// are laid out for it (param_layout.h).
inline constexpr uint64_t kPlaneChunkElems = 64 * 1024;

struct SessionOptimizerOptions {
  wire::DType moment_dtype = wire::DType::kFloat32;
  double max_grad_norm = 0;  // 0: no clipping
  uint64_t seed = 0;
  uint32_t threads = 0;  // worker threads for this plane's engine (0: the whole pool)
};

// An update that landed before a restart, for its step's norm (recovery).
struct CarriedNorm {
  uint64_t step = 0;
  uint64_t param_id = 0;
  double sumsq = 0;
  bool updated = true;  // false: it was skipped (a non-finite gradient)
};

// What AddParameters takes, together (BindState, sessions/param_binding.h).
struct PlaneRegistration {
  SessionOptimizerOptions options;
  std::vector<ParamBinding> params;    // request order
  std::unique_ptr<GradientPool> pool;  // the registration's gradient pool (null: slots)
  bool adopted = false;
  std::vector<CarriedNorm> carried;
};

// Resolves a (region_id, offset, bytes) of one session to a pointer, or
// nullptr when out of range. Provided by the session layer.
using RegionResolver = std::function<void*(uint64_t region_id, uint64_t offset, uint64_t bytes)>;

// One member's rings, as the daemon laid them out (Note [Rings a client can
// write]); the mapping and `resolver` stay valid until Stop() returns.
struct PlaneMember {
  int32_t local_rank = 0;
  uint64_t session_id = 0;
  ControlRings rings;
  RegionResolver resolver;  // the member's regions (state moves)
};

struct PlaneOptions {
  std::string name;         // for logs: "session 7", "group 'KEY'"
  bool group = false;       // see above: solo or group semantics
  uint32_t world_size = 1;  // group: the job's ranks (divisor of the summed gradient)
  bool cross_node = false;  // group: nnodes > 1, local rank 0 all-reduces each sum
  SessionFaultFn on_fault;  // a member broke the wire rules; may be empty
};

class OptimizerPlane {
 public:
  // `members` is indexed by local rank (a solo plane has one); `pool` must
  // outlive the plane. The thread starts at once; commands that arrive before
  // the first AddParameters are answered with ERROR.
  OptimizerPlane(PlaneOptions options, std::vector<PlaneMember> members,
                 optimizer::WorkerPool* pool);
  // Stops (as Stop("", -1)).
  ~OptimizerPlane();
  OptimizerPlane(const OptimizerPlane&) = delete;
  OptimizerPlane& operator=(const OptimizerPlane&) = delete;

  // Adds parameters (RegisterParameters; a group adds all of its parameters
  // once, when it forms). Callable from any thread; the plane applies them
  // before it handles the next command (the engine's AddParam is not
  // concurrent with updates). The first call's `options` create the engine;
  // later calls must repeat its moment_dtype, max_grad_norm and seed. The
  // moments and master are initialised by the worker threads (first touch),
  // master from the param slot's contents (which the client wrote before
  // registering) on the first kParamFromSlot of local rank 0.
  // Returns OK, else INVALID_ARGUMENT naming what is wrong.
  // `adopted`: the parameters' state was adopted after a restart
  // (daemon/recovery/): master and moments stay as they are (no
  // kParamFromSlot), their torch steps come from their manifest entries.
  // `carried`: norms of updates that landed before the restart, counted in
  // their steps (AdamWEngine::CarryNorm).
  // `pool`: the registration's gradient staging pool, which the bindings'
  // `pool` point to (solo planes; null: slots); the plane owns it from here.
  Status AddParameters(const SessionOptimizerOptions& options, std::vector<ParamBinding> params,
                       bool adopted = false, std::vector<CarriedNorm> carried = {},
                       std::unique_ptr<GradientPool> pool = nullptr);

  // Stops the thread and waits for in-flight updates; afterwards no member's
  // memory is touched by the plane. Then, when `why` is not empty, posts
  // GROUP_BROKEN with `why` to every member but local rank `leaver` (whose
  // memory may already be going away). Idempotent.
  void Stop(const std::string& why, int leaver);

  // Non-empty once a group failed (see above): why. Always "" for solo planes.
  std::string failure() const;

  // Worker threads the engine runs on (0 until the first parameters are
  // applied): the `threads` option, or the whole pool.
  unsigned engine_workers() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace trainstream::daemon
