// OptimizerService: the daemon's data plane for optimizer sessions. For each
// session with registered parameters it runs one thread that consumes the
// session's command ring (GRAD_READY, STEP_END, LOAD/EXPORT_STATE), hands the
// work to the AdamW engine (daemon/optimizer/) and answers on the completion
// ring. The session layer (sessions, segments, RPC handlers) owns all memory;
// this service only borrows pointers between AddParameters and EndSession.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "planes/client_rings.h"
#include "trainstream/status.h"
#include "trainstream/wire/dtype.h"
#include "trainstream/wire/session_control.h"

namespace trainstream::optimizer {
class WorkerPool;
}

namespace trainstream::daemon {

class AdamWSessionPlane;  // optimizer_service.cc

// One registered parameter, with every pointer it needs (all owned by the
// session layer, valid until EndSession returns).
struct ParamBinding {
  uint64_t param_id = 0;
  std::string name;
  uint64_t numel = 0;
  uint32_t group = 0;
  wire::DType param_dtype = wire::DType::kFloat32;  // checked by ValidateRegistration
  wire::DType grad_dtype = wire::DType::kFloat32;
  float* master = nullptr;           // fp32[numel], state segment
  void* exp_avg = nullptr;           // moment dtype[numel], state segment
  void* exp_avg_sq = nullptr;        // moment dtype[numel], state segment
  void* grad_slot = nullptr;         // grad dtype[numel], session staging segment
  void* param_slot = nullptr;        // param dtype[numel], session staging segment
  uint64_t* step_counter = nullptr;  // the manifest entry's step, kept current
};

struct SessionOptimizerOptions {
  wire::DType moment_dtype = wire::DType::kFloat32;
  double max_grad_norm = 0;  // 0: no clipping
  uint64_t seed = 0;
  uint32_t threads = 0;  // worker threads for this session (0: the whole pool)
};

// Resolves a (region_id, offset, bytes) of this session to a pointer, or
// nullptr when out of range. Provided by the session layer.
using RegionResolver = std::function<void*(uint64_t region_id, uint64_t offset, uint64_t bytes)>;

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

  // Adds parameters to a started session (RegisterParameters). The moments and
  // master are initialised by the worker threads (first touch), master from the
  // param slot's contents (which the client wrote before registering).
  // Returns OK, else INVALID_ARGUMENT naming what is wrong (RegisterParameters
  // answers with it as it is).
  Status AddParameters(uint64_t session_id, const SessionOptimizerOptions& options,
                       std::vector<ParamBinding> params);

  // Stops the session's thread and waits for in-flight work; afterwards no
  // pointer of the session is touched. Safe to call for unknown ids.
  void EndSession(uint64_t session_id);

  unsigned worker_threads() const;

  // The AdamW worker pool (data-parallel groups run their engines on it too).
  optimizer::WorkerPool* pool();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace trainstream::daemon
