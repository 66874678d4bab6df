// AdoptionStore: the optimizer state a dead daemon left, held by the daemon
// that took its socket until its client re-attaches (docs/recovery.md,
// "Adoption"; Note [Optimizer state outlives the daemon]).
//
// Before the daemon serves, AdoptFrom looks at the dead daemon's files (its
// socket's tag, Note [Segments outlive a crashed daemon]): each initialised
// state segment is adopted with its staging segment, both checked as hostile
// input (ShmSegment::Adopt, CheckStateSegment), charged to the budget, and
// made whole (CompleteUpdates). The states of one session (one owner proof)
// wait together for `grace_s`. Claim hands a state to the session that shows
// its proof; Sweep drops the ones whose time is up or whose client process is
// gone. A state that cannot be resumed is unlinked at once, but what was lost
// is kept (a few bytes) so its client hears exactly which step.
//
// Thread-safe. Owns the segments it holds; the hooks give their bytes back.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "memory/shm_segment.h"
#include "recovery/owner.h"
#include "recovery/state_recovery.h"
#include "trainstream/platform/user.h"
#include "trainstream/status.h"
#include "trainstream/v1/control.pb.h"

namespace trainstream::daemon {

struct AdoptedRegistration {
  std::unique_ptr<ShmSegment> state;
  std::unique_ptr<ShmSegment> staging;
  StateSegmentView view;  // pointers into `state`
  RecoveryReport report;  // what CompleteUpdates found and did
};

// One dead session's optimizer state.
struct AdoptedState {
  OwnerProof proof{};
  platform::UserId uid = 0;
  pid_t pid = 0;  // the client that registered it, and its start time
  uint64_t start = 0;
  std::string job;
  std::vector<AdoptedRegistration> registrations;  // by registration index
  wire::StepRecord step{};                         // the most advanced step record of its segments
  // Non-empty: it cannot be resumed (names the step); its segments are gone.
  std::string lost;
  uint64_t lost_step = 0;
  std::chrono::steady_clock::time_point adopted, deadline;
  uint64_t bytes() const;
};

// How the store charges what it holds (the session registry's budget).
struct AdoptionHooks {
  std::function<Status(uint64_t bytes, const std::string& what)> reserve;
  std::function<void(uint64_t bytes)> release;            // a reservation left unused
  std::function<void(const ShmSegment&)> held;            // now held (pinned accounting)
  std::function<void(std::unique_ptr<ShmSegment>)> drop;  // unlink, give its bytes back
};

class AdoptionStore {
 public:
  AdoptionStore(AdoptionHooks hooks, bool lock_memory, uint64_t grace_s);
  ~AdoptionStore();  // drops what still waits
  AdoptionStore(const AdoptionStore&) = delete;
  AdoptionStore& operator=(const AdoptionStore&) = delete;

  struct Scan {
    uint64_t states = 0;  // sessions whose state waits for its client
    uint64_t segments = 0;
    uint64_t bytes = 0;
    uint64_t restored_subchunks = 0;
    uint64_t rolled_forward = 0;
    std::set<std::string> kept;      // names the caller must not remove
    std::vector<std::string> notes;  // what was not adopted, and why (for the log)
  };
  // Adopts what a dead daemon tagged `tag` left in `dir` (see above). Call
  // before the daemon serves, with no other daemon on the socket.
  Scan AdoptFrom(const std::string& dir, const std::string& tag);

  // Hands over the state proven by `proof` for `uid`. NOT_FOUND when none waits
  // (never says whether another uid's does); FAILED_PRECONDITION with the lost
  // step when it cannot be resumed (the record goes with this answer).
  Status Claim(const OwnerProof& proof, platform::UserId uid, std::unique_ptr<AdoptedState>* out);

  // Drops the states whose grace period is over or whose client is gone.
  void Sweep();

  size_t size();
  // Each waiting state's segments, as session 0's, labelled for status.
  void FillStatus(v1::StatusResponse* out);

 private:
  void Drop(std::unique_ptr<AdoptedState> s, const std::string& why);
  void DropSegments(AdoptedState& s);

  const AdoptionHooks hooks_;
  const bool lock_memory_;
  const uint64_t grace_s_;
  std::mutex mu_;
  std::vector<std::unique_ptr<AdoptedState>> states_;  // Guarded by mu_.
};

}  // namespace trainstream::daemon
