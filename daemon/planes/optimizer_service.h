// OptimizerService: the AdamW worker pool and the optimizer planes of solo
// sessions. Each session with a data plane gets one OptimizerPlane
// (optimizer_plane.h) of one member, created at StartSession and stopped at
// EndSession. Data-parallel groups create their planes on the same pool
// (GroupRegistry). The session layer (sessions, segments, RPC handlers) owns
// all memory; the planes only borrow pointers between StartSession and
// EndSession.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "planes/optimizer_plane.h"
#include "trainstream/status.h"

namespace trainstream::optimizer {
class WorkerPool;
}

namespace trainstream::daemon {

class OptimizerService {
 public:
  // `threads`: worker threads for AdamW (0: one per physical core).
  explicit OptimizerService(unsigned threads);
  ~OptimizerService();
  OptimizerService(const OptimizerService&) = delete;
  OptimizerService& operator=(const OptimizerService&) = delete;

  // Where a session that breaks the wire rules (client_rings.h) is reported.
  // Set once, before any session starts.
  void SetFaultHandler(SessionFaultFn on_fault);

  // Starts serving `session_id`'s rings, laid out as `rings` says (the daemon's
  // copy, see Note [Rings a client can write]).
  void StartSession(uint64_t session_id, const ControlRings& rings, RegionResolver resolver);

  // Adds parameters to a started session (RegisterParameters; see
  // OptimizerPlane::AddParameters). Returns OK, else INVALID_ARGUMENT naming
  // what is wrong (RegisterParameters answers with it as it is).
  // `adopted` and `carried`: state a restarted daemon adopted (see there).
  Status AddParameters(uint64_t session_id, const SessionOptimizerOptions& options,
                       std::vector<ParamBinding> params, bool adopted = false,
                       std::vector<CarriedNorm> carried = {},
                       std::unique_ptr<GradientPool> pool = nullptr);

  // Stops the session's plane and waits for in-flight work; afterwards no
  // pointer of the session is touched. Safe to call for unknown ids.
  void EndSession(uint64_t session_id);

  unsigned worker_threads() const;

  // The AdamW worker pool (data-parallel groups run their planes on it too).
  optimizer::WorkerPool* pool();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace trainstream::daemon
