// GroupRegistry: data-parallel groups (docs/data-parallel.md). The ranks of one
// job on this machine attach with the same GroupMembership key; together they
// hold ONE optimizer state, one shared staging segment (a grad slot per rank,
// an fp32 sum slot and one param slot per parameter): one Registration, made and
// resumed as a solo session's is (Note [One path for sessions and groups],
// param_binding.h), served by one group plane that OptimizerService runs.
//
// Life of a group:
//   forming   ranks attach (Join) and register their parameters (Register).
//             Register is a barrier: it returns once every local rank has
//             registered the same parameters with the same initial weights
//             (checksums), or fails for all of them, naming the difference.
//   running   the plane serves every member's rings.
//   resuming  (instead of forming, after a daemon restart: docs/recovery.md)
//             ranks re-attach with the group's recovery token (Rejoin); the
//             first one claims the state this daemon adopted, and once every
//             local rank is back the plane starts on it. Every rank's attach
//             waits for that, or fails with the same message for all.
//   broken    a member left (detached, or its process died), a registration
//             disagreed, or the barrier timed out. The plane stops before the
//             leaver's memory is unmapped, every other member is sent
//             GROUP_BROKEN naming the rank, the group's segments are freed at
//             once and its key is free for a new group. Members still attached
//             keep their own sessions until they detach.
//
// Locking (acquire in this order): Session::mu (SessionRegistry::End), then
// GroupRegistry::mu_, then Group::mu. Register waits on Group::cv holding only
// Group::mu (released while waiting).
#pragma once

#include <sys/types.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>

#include "planes/optimizer_plane.h"
#include "recovery/adoption.h"
#include "sessions/param_binding.h"
#include "trainstream/platform/user.h"
#include "trainstream/status.h"
#include "trainstream/v1/control.pb.h"

namespace trainstream::daemon {

class Group;
class OptimizerService;

// Most local ranks one group may have (one bit each in the plane's masks).
inline constexpr int32_t kMaxLocalWorldSize = 64;
inline constexpr size_t kMaxGroupKeyBytes = 200;
inline constexpr double kDefaultGroupTimeoutS = 60;

// Who is joining: what the session layer knows of the attaching session.
struct GroupJoiner {
  uint64_t session_id = 0;
  pid_t pid = 0;
  platform::UserId uid = 0;
  std::string job;
  ControlRings rings;       // the session's rings, as the daemon laid them out
  RegionResolver resolver;  // the session's regions (state transfers)
};

class GroupRegistry {
 public:
  // `memory` (where a group's segments come from) and `planes` (which runs
  // each group's plane) must outlive the registry.
  GroupRegistry(const StateMemory* memory, OptimizerService* planes);
  ~GroupRegistry();
  GroupRegistry(const GroupRegistry&) = delete;
  GroupRegistry& operator=(const GroupRegistry&) = delete;

  // Checks a membership's fields alone; INVALID_ARGUMENT names the field and
  // the accepted range. Call before creating anything for the session.
  static Status Validate(const v1::GroupMembership& m);

  // Adds the session to its group (creating the group for the first rank).
  // Fails when the membership disagrees with the group's (local world size,
  // node rank, ...), the local rank is taken, or the group has already formed.
  // `joiner.rings.control` must stay mapped until Leave(joiner.session_id) returns.
  Status Join(const GroupJoiner& joiner, const v1::GroupMembership& m);

  // The barrier described above. On success fills `resp` with the shared
  // staging region and this rank's slots.
  Status Register(uint64_t session_id, const v1::RegisterParametersRequest& req,
                  v1::RegisterParametersResponse* resp);

  // A rank of a group whose daemon died re-attaches (see "resuming" above)
  // showing `proof` of the group's recovery token. The first claims the state
  // from `store`; the call returns once every local rank is back and the plane
  // runs, filling `out` with the state and this rank's slots, or fails: the
  // store's NOT_FOUND / FAILED_PRECONDITION, a rank that did not come back
  // within the group's timeout, or a membership that is not the group's.
  Status Rejoin(const GroupJoiner& joiner, const v1::GroupMembership& m, const OwnerProof& proof,
                AdoptionStore* store, v1::ResumedState* out);

  // The session is ending (`reason` says why). Breaks its group (see above);
  // when this returns, the group no longer touches the session's memory.
  // Safe for sessions in no group.
  void Leave(uint64_t session_id, const std::string& reason);

  // The group key of a session ("" when none).
  std::string KeyOf(uint64_t session_id);

  // Adds every group (and its segments, with session_id 0) to a status answer.
  void FillStatus(v1::StatusResponse* out);

 private:
  // Every group, joinable (groups_) or broken and still held by members (by_session_).
  std::set<std::shared_ptr<Group>> AllGroups();              // takes mu_
  Status Form(Group& g);                                     // Group::mu held
  void StartPlane(Group& g, const std::string& name);        // Group::mu held
  void Break(Group& g, const std::string& why, int leaver);  // Group::mu held

  const StateMemory* const memory_;
  OptimizerService* const planes_;

  std::atomic<uint64_t> next_plane_{1};  // names each group's plane (kGroupPlane | n)
  std::mutex mu_;
  // (uid, key) -> the group new ranks join. A broken group leaves this map
  // (its key is free again) but lives on in by_session_ until its members leave.
  std::map<std::pair<platform::UserId, std::string>, std::shared_ptr<Group>>
      groups_;                                             // Guarded by mu_.
  std::map<uint64_t, std::shared_ptr<Group>> by_session_;  // Guarded by mu_.
};

}  // namespace trainstream::daemon
