// ClientMemoryGuard: makes the daemon's mappings of shm segments safe to touch
// even when a client shrinks the file under them.
//
// Note [Client pages can vanish]. A segment's file belongs to the attaching user
// (it must, so that user can map it), and a file's owner can always ftruncate
// it. The pages past the new end then leave every mapping at once, and the next
// access by any daemon thread (an AdamW worker writing weights, the ring thread,
// an export) raises SIGBUS, which kills the daemon and every session on the
// machine. Two ways out were weighed:
//   1. sealed memfds (F_SEAL_SHRINK | F_SEAL_GROW) passed over the unix socket
//      with SCM_RIGHTS: the kernel refuses the truncate. But gRPC cannot carry
//      fds, so every region would need a second socket protocol, and a memfd
//      dies with its last holder, which rules out re-adopting optimizer state
//      after a daemon restart (the recovery design keeps state in named files);
//   2. a SIGBUS handler that knows every mapping a client can shrink: a fault
//      inside one replaces that whole mapping with private zero pages (mmap
//      MAP_FIXED | MAP_ANONYMOUS, a system call, safe in a handler), records
//      the fault and returns, so the faulting instruction retries and
//      completes on memory nobody else sees. The session layer then ends the
//      owning session. A fault anywhere else is a daemon bug and still kills
//      the daemon (the default action, with its core).
// We use 2, as Wayland compositors do for client buffers (wl_shm): it costs
// nothing per access (no check on the hot path), needs no protocol change,
// covers every thread and every kind of segment, and keeps files for recovery.
// The rule that follows: every daemon mapping of a file a client could open is
// made through ShmSegment, which registers it here before its first access and
// unregisters it before munmap.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "trainstream/status.h"

namespace trainstream::platform {
class WakeEvent;
}

namespace trainstream::daemon {

// The faults themselves are the platform seam's (platform/mapping_faults.h:
// SIGBUS on Linux; none on Windows, where a mapped file cannot shrink).
class ClientMemoryGuard {
 public:
  // Ranges one daemon may guard at once (one per segment). Register fails past it.
  static constexpr size_t kMaxRanges = size_t{1} << 17;

  // Installs the fault handler (SIGBUS) once per process; later calls do nothing but
  // answer the same. INTERNAL says why it could not.
  static Status Install();

  // Registers [base, base + bytes) on behalf of `owner` (a session id; 0 for the
  // daemon's own, e.g. bases). Returns a handle >= 0, or -1 when kMaxRanges are
  // in use. The range must stay mapped until Unregister(handle) returns.
  static int Register(void* base, size_t bytes, uint64_t owner);
  static void Unregister(int handle);
  // Reports later faults of `handle`'s range as `owner`'s (an adopted segment
  // passing to the session that claimed it).
  static void SetOwner(int handle, uint64_t owner);

  // True once the range of `handle` faulted (its contents are zeros since).
  static bool Faulted(int handle);

  // Set after a fault (null before Install); TakeFaults() clears it and
  // returns the owners of ranges that faulted since the last call (each once).
  static platform::WakeEvent* FaultEvent();
  static std::vector<uint64_t> TakeFaults();
};

}  // namespace trainstream::daemon
