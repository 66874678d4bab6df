// The platform seam for what the machine offers the daemon: its physical
// memory (the budget's "50%"), the space of the file system that holds the
// segments, and how much memory this process may lock. Two sides, picked by
// platform/CMakeLists.txt: machine_linux.cc (sysconf, statvfs,
// RLIMIT_MEMLOCK) and machine_windows.cc (GlobalMemoryStatusEx,
// GetDiskFreeSpaceExW; no fixed lock limit). CPUs are platform/threads.h's.
#pragma once

#include <cstdint>
#include <string>

namespace trainstream::platform {

// Physical memory in bytes; 0 when the system does not say.
uint64_t PhysicalMemoryBytes();

// The bytes free (to this user) and in all of the file system that holds
// `dir`. Returns 0 or an errno value.
int FileSystemSpace(const std::string& dir, uint64_t* free_bytes, uint64_t* total_bytes);

// How many bytes this process may lock in memory before a lock fails:
// RLIMIT_MEMLOCK's soft limit on Linux (UINT64_MAX when unlimited); UINT64_MAX
// on Windows, where the lock raises the working-set quota it needs (Note
// [Locking memory on Windows], shm_windows.cc) and what remains is the
// machine's memory. 0 when the system does not say.
uint64_t LockedMemoryLimit();

// Hands the heap's free pages back to the system now (after a burst of
// short-lived allocations): malloc_trim(0) on Linux, _heapmin on Windows.
void ReturnFreedMemory();

}  // namespace trainstream::platform
