// Who owns an optimizer state that outlives its daemon (docs/recovery.md,
// "Re-attaching"): the proof a client shows for it, and whether the client
// process that registered it still runs.
#pragma once

#include <sys/types.h>

#include <array>
#include <cstdint>
#include <string>

namespace trainstream::daemon {

using OwnerProof = std::array<uint8_t, 32>;

// SHA-256 of a recovery token (OpenSSL): what a state segment keeps instead of
// the token, so reading the segment does not give the token away.
OwnerProof ProofOf(const std::string& recovery_token);

// The start time of process `pid` (platform/process_watcher.h: clock ticks
// since boot on Linux, the creation time on Windows), or 0 when there is no
// such process (or it exited: a zombie). With the pid it names one process for
// good: a pid reused later has another start time.
uint64_t ProcessStartTime(pid_t pid);

// True while the process (pid, start) recorded by ProcessStartTime runs.
bool ProcessAlive(pid_t pid, uint64_t start);

}  // namespace trainstream::daemon
