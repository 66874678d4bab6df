// OptimizerService: the AdamW worker pool and every optimizer plane
// (optimizer_plane.h): a solo session's, started when the session attaches,
// and a data-parallel group's, started when the group forms or resumes
// (GroupRegistry). A plane is named by an id: a solo session's is the session
// id, a group's has kGroupPlane set. The session layer (sessions, segments, RPC
// handlers) owns all memory; a plane only borrows pointers between StartPlane
// and StopPlane.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "planes/optimizer_plane.h"
#include "trainstream/status.h"

namespace trainstream::daemon {

// Set in every group plane's id, never in a session id.
inline constexpr uint64_t kGroupPlane = uint64_t{1} << 63;

class OptimizerService {
 public:
  // `threads`: worker threads for AdamW (0: one per physical core).
  explicit OptimizerService(unsigned threads);
  ~OptimizerService();  // stops every plane
  OptimizerService(const OptimizerService&) = delete;
  OptimizerService& operator=(const OptimizerService&) = delete;

  // Where a member that breaks the wire rules (client_rings.h) is reported, for
  // every plane. Set once, before any plane starts.
  void SetFaultHandler(SessionFaultFn on_fault);

  // Starts plane `id` serving `members`' rings (a solo plane has one), laid out
  // as each says (the daemon's copy, see Note [Rings a client can write]).
  void StartPlane(uint64_t id, PlaneOptions options, std::vector<PlaneMember> members);

  // Adds parameters to plane `id` (OptimizerPlane::AddParameters). Returns OK,
  // else INVALID_ARGUMENT naming what is wrong (RegisterParameters answers with
  // it as it is).
  Status AddParameters(uint64_t id, PlaneRegistration params);

  // Stops plane `id` and waits for in-flight work; afterwards no pointer it
  // borrowed is touched. A non-empty `why` then goes to every member but
  // `leaver` as GROUP_BROKEN (OptimizerPlane::Stop). Safe for unknown ids.
  void StopPlane(uint64_t id, const std::string& why = "", int leaver = -1);

  // Why group plane `id` failed ("" when it did not, or is not running).
  std::string failure(uint64_t id);

  unsigned worker_threads() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace trainstream::daemon
