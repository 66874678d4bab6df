// GroupPlane: the optimizer data plane of one data-parallel group (the ranks
// of one job on this machine; docs/data-parallel.md). One thread consumes every
// member's command ring; one AdamW engine holds the group's single optimizer
// state.
//
// Per parameter and step:
//   1. each local rank copies its gradient into its own grad slot and posts
//      GRAD_READY on its ring;
//   2. once every local rank has, the plane sums the slots into the fp32 sum
//      slot and divides by the job's world size (DDP's mean);
//   3. with several machines (nnodes > 1) it posts REDUCE_READY to local rank
//      0, which all-reduces the sum slot across machines with torch.distributed
//      and answers GRAD_REDUCED;
//   4. the engine updates the parameter once and writes the new weights into
//      the one param slot every member maps; PARAM_READY goes to every member.
// STEP_END is applied once every local rank has posted it. Clipping uses the
// global norm of the summed gradients (the engine only ever sees those).
//
// Why slots are never overwritten while in use: a rank posts step s+1's
// gradient only after its step s finished (it copied every new weight), and the
// update of step s+1 waits for every rank's gradient, so no rank can still be
// reading a param slot, and no sum slot is still being read, when it is
// rewritten.
//
// Ranks that disagree (different steps, hyper-parameters, or sets of
// parameters with gradients) make the plane fail: every member receives
// GROUP_BROKEN naming the rank and what differs, and every later command that
// a client waits on is answered the same way. A client's mistake never wedges
// the daemon.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "planes/optimizer_service.h"

namespace trainstream::optimizer {
class WorkerPool;
}

namespace trainstream::daemon {

// One member's rings, as the daemon laid them out (Note [Rings a client can
// write]); the mapping and `resolver` stay valid until Stop() returns.
struct GroupMemberRings {
  int32_t local_rank = 0;
  uint64_t session_id = 0;
  ControlRings rings;
  RegionResolver resolver;
};

// One parameter of the group. `param.grad_slot` is ignored: the engine reads
// `sum_slot`; `rank_grads[r]` is local rank r's gradient slot.
struct GroupParamBinding {
  ParamBinding param;
  std::vector<void*> rank_grads;
  float* sum_slot = nullptr;
};

struct GroupPlaneOptions {
  std::string name;         // for logs: the group key
  uint32_t world_size = 1;  // the job's ranks (divisor of the summed gradient)
  bool cross_node = false;  // nnodes > 1: local rank 0 all-reduces each sum
  SessionOptimizerOptions optimizer;
  SessionFaultFn on_fault;  // a member broke the wire rules; may be empty
};

class GroupPlane {
 public:
  // `members` is indexed by local rank; `pool` must outlive the plane. The
  // thread starts at once.
  GroupPlane(GroupPlaneOptions options, std::vector<GroupMemberRings> members,
             std::vector<GroupParamBinding> params, optimizer::WorkerPool* pool);
  // Stops (as Stop("", -1) without notices).
  ~GroupPlane();
  GroupPlane(const GroupPlane&) = delete;
  GroupPlane& operator=(const GroupPlane&) = delete;

  // Stops the thread and waits for in-flight updates; afterwards no member's
  // memory is touched by the plane. Then, when `why` is not empty, posts
  // GROUP_BROKEN with `why` to every member but local rank `leaver` (whose
  // memory may already be going away). Idempotent.
  void Stop(const std::string& why, int leaver);

  // Non-empty once the ranks disagreed (see above): why.
  std::string failure() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace trainstream::daemon
