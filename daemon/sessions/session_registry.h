// SessionRegistry: every attached session and the memory it holds. The RPC
// handlers (control_service.cc) call one method per request; teardown (stream
// closed, client process dead, daemon shutting down) goes through End().
//
// Locking (acquire in this order, never the reverse):
//   SessionRegistry::mu_  guards the id -> session map and the id counters
//   Session::mu           guards the session's segments, params and `closed`
//   Session::regions_mu   guards the region table (read by the optimizer's
//                         RegionResolver on its own threads, which never take mu)
//   Session::stream_mu    guards the stream pointer (notices, cancel)
//
// A session that breaks the wire rules (a corrupt ring, a truncated segment) is
// reported from the thread that found it through EndLater(), which never blocks;
// the reaper thread ends it with End() and tells the client why.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "memory/budget.h"
#include "memory/shm_segment.h"
#include "planes/client_rings.h"
#include "process/config.h"
#include "recovery/adoption.h"
#include "recovery/owner.h"
#include "security/caller.h"
#include "sessions/param_binding.h"
#include "trainstream/platform/mapping_faults.h"
#include "trainstream/status.h"
#include "trainstream/v1/control.pb.h"

namespace trainstream::daemon {

class GroupRegistry;
class OptimizerService;

// The session stream as the registry uses it: events out, and a cancel that
// makes the transport's Attach handler return. The transport implements it over
// its gRPC stream (Note [One Status below the transport], trainstream/status.h).
class SessionStream {
 public:
  virtual ~SessionStream() = default;
  // Sends `event`; false once the stream is closed.
  virtual bool Write(const v1::SessionEvent& event) = 0;
  // Ends the call from the daemon's side; the client sees it cancelled.
  virtual void Cancel() = 0;
};

// Ring geometry of a session's control region (session_control.h).
inline constexpr uint64_t kRingCapacity = 4096;
inline constexpr uint64_t kMaxControlBytes = 64ull << 20;
// Most regions one session may hold at once (each is a segment and a mapping:
// the machine's vm.max_map_count is shared by every session).
inline constexpr size_t kMaxRegionsPerSession = 4096;
// Most sessions one uid may hold at once: each holds a gRPC thread, a plane
// thread and a control segment, and one connection can carry many streams.
inline constexpr size_t kMaxSessionsPerUid = 256;
uint64_t MinControlBytes();

// One region of a session: a whole segment handed out as (segment, offset, length).
struct SessionRegion {
  uint64_t region_id = 0;
  std::unique_ptr<ShmSegment> segment;
  std::string label;    // "control", "staging", "optimizer-state" or the client's label
  uint64_t offset = 0;  // kSegmentHeaderBytes: data starts after the header
  uint64_t length = 0;
  bool client_freeable = false;  // AllocateRegion regions only
};

class Session {
 public:
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;
  Session() = default;

  // Set once at creation, then read-only.
  uint64_t id = 0;
  std::string token;
  PeerCredentials creds;
  std::string job;
  int32_t rank = -1, local_rank = -1;
  std::string group;  // data-parallel group key ("" when none)
  std::chrono::steady_clock::time_point started;
  uint64_t control_region_id = 0;
  ControlRings rings;  // the control region's layout, as the daemon wrote it
  // Recovery (docs/recovery.md): the token the client keeps, its SHA-256 that
  // the session's state segments hold, and the client's start time. Empty
  // token: recovery is off.
  std::string recovery_token;
  OwnerProof owner_proof{};
  uint64_t owner_start = 0;

  std::mutex mu;
  bool closed = false;           // Guarded by mu.
  std::set<uint64_t> param_ids;  // Guarded by mu.
  uint32_t registrations = 0;    // Guarded by mu: RegisterParameters calls that succeeded

  std::mutex regions_mu;
  std::map<uint64_t, SessionRegion> regions;  // Guarded by regions_mu (writes also hold mu).
  // Regions freed by the client while the optimizer may still hold pointers
  // into them: unlinked at once, unmapped at teardown. Guarded by mu.
  std::vector<SessionRegion> retired;

  std::mutex stream_mu;
  SessionStream* stream = nullptr;  // Guarded by stream_mu; null once ended.

  // Sends an event on the session stream if it is still open.
  bool Send(const v1::SessionEvent& event);
  // Regions and bytes, for status.
  uint64_t BytesHeld();
};

class SessionRegistry {
 public:
  // `budget` and `optimizer` (not null) must outlive the registry.
  // `on_session_start(id, pid)` / `on_session_end(id)` let the daemon watch pids.
  SessionRegistry(const DaemonConfig& config, Budget* budget, OptimizerService* optimizer);
  SessionRegistry(const SessionRegistry&) = delete;
  SessionRegistry& operator=(const SessionRegistry&) = delete;
  ~SessionRegistry();

  void SetPidHooks(std::function<bool(uint64_t, pid_t)> watch,
                   std::function<void(uint64_t)> unwatch);
  // Called with the session id at the end of End(), after `closed` is set and
  // the session's memory is freed (e.g. the base cache drops its references).
  // Set before sessions exist.
  void AddEndHook(std::function<void(uint64_t)> hook) { end_hooks_.push_back(std::move(hook)); }

  // Attach: creates the session and its control segment, registers the stream
  // (which must outlive the session's use of it: the caller takes it back,
  // under stream_mu, before it goes).
  Status Create(const PeerCredentials& creds, const v1::AttachRequest& req, SessionStream* stream,
                std::shared_ptr<Session>* out, v1::Attached* attached);

  // Finds the session for a unary RPC: NOT_FOUND for an unknown id,
  // PERMISSION_DENIED for a wrong token or another user's session.
  Status Find(uint64_t session_id, const std::string& token, const PeerCredentials& caller,
              std::shared_ptr<Session>* out);

  // Ends a session: marks it closing, stops its optimizer plane, unmaps and
  // unlinks its segments, returns its budget. With `cancel_stream`, also cancels
  // the session stream (the handler then returns). Idempotent.
  void End(uint64_t session_id, const std::string& reason, bool cancel_stream);
  // Ends every session (daemon shutdown), without cancelling streams.
  void EndAll(const std::string& reason);
  // End(session_id, reason, true) soon, on the reaper thread. Never blocks:
  // for the data plane's threads (SessionFaultFn).
  void EndLater(uint64_t session_id, const std::string& reason);

  Status RegisterParameters(Session& s, const v1::RegisterParametersRequest& req,
                            v1::RegisterParametersResponse* resp);
  Status AllocateRegion(Session& s, const v1::AllocateRegionRequest& req, v1::Region* out);
  Status FreeRegion(Session& s, const v1::FreeRegionRequest& req, uint64_t* bytes_freed);

  // Recovery (docs/recovery.md): adopts what a dead daemon tagged `tag` left in
  // `dir` (AdoptionStore::AdoptFrom); nothing when recovery is off. Before serving.
  AdoptionStore::Scan AdoptPrevious(const std::string& dir, const std::string& tag);
  // Drops adopted states whose grace period is over or whose client is gone.
  void SweepAdopted();
  // Adopted states still waiting for their client.
  size_t adopted_waiting();

  // Sends `notice` to every attached session.
  void NotifyAll(const v1::DaemonNotice& notice);
  size_t size();
  void FillStatus(v1::StatusResponse* out);
  uint64_t pinned_bytes() const;

 private:
  Status CreateSegment(const SegmentOwner& owner, uint32_t kind, uint64_t total_bytes,
                       const std::string& what, std::unique_ptr<ShmSegment>* out);
  uint64_t AddRegion(Session& s, std::unique_ptr<ShmSegment> seg, const std::string& label,
                     uint64_t length, bool client_freeable);
  void DropSegment(std::unique_ptr<ShmSegment> seg);
  // Binds a claimed state into the new solo session `s` and describes it in `out`.
  Status Resume(Session& s, std::unique_ptr<AdoptedState> state, v1::ResumedState* out);
  // Hands `reg` to the session's plane, then its segments to the session as
  // regions (s.mu held); `staging` (FillSlots's) gets its region id. On error
  // `reg`'s memory is freed.
  Status Bind(Session& s, Registration reg, v1::Region* staging);
  void FillRegion(const SessionRegion& r, v1::Region* out) const;
  void ReaperLoop();

  const DaemonConfig config_;
  Budget* const budget_;
  OptimizerService* const optimizer_;
  StateMemory memory_;  // every registration's segments, solo and group
  // Data-parallel groups. Declared after the members its callbacks use.
  std::unique_ptr<GroupRegistry> groups_;
  std::function<bool(uint64_t, pid_t)> watch_pid_;
  std::function<void(uint64_t)> unwatch_pid_;
  std::vector<std::function<void(uint64_t)>> end_hooks_;

  std::mutex mu_;
  std::map<uint64_t, std::shared_ptr<Session>> sessions_;  // Guarded by mu_.
  uint64_t next_session_id_ = 1;                           // Guarded by mu_.
  std::atomic<uint64_t> next_region_id_{1};
  std::atomic<uint64_t> pinned_bytes_{0};
  // The dead daemon's optimizer state waiting for its clients; null with
  // recovery off. After the members its hooks use, so it goes first.
  std::unique_ptr<AdoptionStore> adopted_;

  std::mutex reap_mu_;
  std::vector<std::pair<uint64_t, std::string>> reap_queue_;  // Guarded by reap_mu_.
  bool reaper_stop_ = false;                                  // Guarded by reap_mu_.
  std::unique_ptr<platform::WakeEvent> reaper_wake_;          // set by EndLater and at exit
  std::thread reaper_;  // last: started once every member above exists
};

}  // namespace trainstream::daemon
