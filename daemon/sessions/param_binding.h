// One registration's optimizer state, from a RegisterParameters request or a
// dead daemon's adopted segments to the optimizer plane's input (optimizer_plane.h)
// and the client's slots. SessionRegistry (a solo session) and GroupRegistry (a
// data-parallel group) both go through these functions.
//
// Note [One path for sessions and groups]
// A solo session's registration and a group's hold the same things: a state
// segment and a staging segment, described by the StateSegmentView that a
// restarted daemon's adoption builds of them (CheckStateSegment,
// recovery/state_recovery.h). A fresh registration gets that view from its
// layout as its manifest is written (CreateRegistration, WriteState); an adopted
// one brings it (ResumeRegistration). Everything after reads the view alone:
// BindState makes the plane's bindings, FillSlots tells a client (a group's
// local rank) where its slots lie. So an option of the request or a slot of the
// layout reaches both kinds, fresh and resumed, through one function each, and
// a resumed state is bound the way it was when fresh. What differs is who holds
// it: a solo session's registrations become regions of the session and go to
// its plane; a group's one registration is the group's, served by the group's
// plane. OptimizerService owns both kinds of plane.
#pragma once

#include <sys/types.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "memory/shm_segment.h"
#include "planes/optimizer_plane.h"
#include "recovery/adoption.h"
#include "recovery/state_recovery.h"
#include "sessions/param_layout.h"
#include "trainstream/v1/control.pb.h"

namespace trainstream::daemon {

// Creates / frees a segment against the machine budget (SessionRegistry's).
using SegmentFactory =
    std::function<Status(uint32_t kind, uint64_t bytes, const std::string& what,
                         const SegmentOwner& owner, std::unique_ptr<ShmSegment>* out)>;
using SegmentDropper = std::function<void(std::unique_ptr<ShmSegment>)>;

// Where every registration's segments come from, and whether (and how) its
// state carries recovery records (Note [Optimizer state outlives the daemon]).
struct StateMemory {
  SegmentFactory create;
  SegmentDropper drop;
  RecoveryLayoutOptions recovery;
};

// One registration's optimizer state, fresh or adopted, of a session or a group.
struct Registration {
  std::unique_ptr<ShmSegment> state, staging;
  StateSegmentView view;  // where its state and slots lie (the Note above)
  // Adopted only: what the adoption found and did, and the norms of updates
  // that landed in a step the client ends again.
  bool adopted = false;
  RecoveryReport report;
  std::vector<CarriedNorm> carried;
};

// Lays out validated `req` (`group_ranks` gradient slots and a sum slot per
// parameter for a group; 0: a solo session's), creates both segments for
// `owner` (`who` names them in a budget error) and writes the state's manifest,
// with recovery on its recovery header too, naming `client` and the staging.
Status CreateRegistration(const StateMemory& memory, const v1::RegisterParametersRequest& req,
                          uint32_t group_ranks, const SegmentOwner& owner, RecoveryOwner client,
                          const std::string& who, Registration* out);

// An adopted registration, bound as `group_ranks` says (0: a solo session's),
// whose steps up to `done` the client has seen end.
Registration ResumeRegistration(AdoptedRegistration adopted, const wire::StepRecord& done,
                                uint32_t group_ranks);

// The client process (`pid`, started at `start`) owns the adopted `r` from now
// on, so a later crash is recovered the same way; its segments belong to
// `session_id` (0: a group's).
void SetOwner(Registration& r, uint64_t session_id, pid_t pid, uint64_t start);

void DropRegistration(const StateMemory& memory, Registration& r);

// The plane's input for `r` (its carried norms move along). The pointers are
// into its segments' mappings.
PlaneRegistration BindState(Registration& r);
// The same for the state `v` describes, in a state segment mapped at
// `state_base` and a staging segment mapped at `staging_base`. `adopted`: a
// gradient pool's header is the client's, which resumes where its replays are.
PlaneRegistration BindState(const StateSegmentView& v, char* state_base, char* staging_base,
                            bool adopted = false);

// Where local rank `local_rank` (0 in a solo session) finds `r`: its staging
// region (region id 0: the caller sets its own), slots and gradient pool, and
// for a resumed one what became of each parameter.
void FillSlots(const Registration& r, int32_t local_rank, v1::RegisterParametersResponse* out);
void FillSlots(const Registration& r, int32_t local_rank, v1::ResumedRegistration* out);

// Writes the manifest of a fresh state segment mapped at `state_base`
// (WriteStateManifest; recovery records with `owner` not null) for `req` laid
// out as `layout`, and returns its view: the fields CheckStateSegment reads back
// that BindState and FillSlots use.
StateSegmentView WriteState(char* state_base, const RegistrationLayout& layout,
                            const v1::RegisterParametersRequest& req,
                            const RecoveryOwner* owner = nullptr);

}  // namespace trainstream::daemon
