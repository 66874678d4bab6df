// The platform seam for where threads run: which CPUs the process may use, how
// they group into physical cores, and pinning and naming the calling thread.
// The daemon's AdamW worker pool (daemon/optimizer/worker_pool.cc) uses it and
// nothing else for these; threads_linux.cc and threads_windows.cc are its two
// sides, picked by platform/CMakeLists.txt (docs/windows.md).
//
// CPU ids are the operating system's logical processor numbers: Linux's CPU
// numbers, Windows' bit positions in the process affinity mask. On Windows only
// the process's processor group is seen (at most 64 logical processors), the
// group its affinity mask describes.
#pragma once

#include <string>
#include <vector>

namespace trainstream::platform {

// The logical CPUs this process may run on (its affinity mask), ascending.
// Empty when the operating system does not say.
std::vector<int> AllowedCpus();

// The physical core logical CPU `cpu` belongs to: a package (socket) id and a
// core id, unique together. Hyper-thread siblings share both. Returns false
// when the topology is unknown for `cpu`.
struct CpuCore {
  int package = 0;
  int core = 0;
};
bool CoreOfCpu(int cpu, CpuCore* out);

// Pins the calling thread to logical CPU `cpu`. Returns false when the system
// refused (the thread then runs where it ran before).
bool PinCurrentThread(int cpu);

// The logical CPU the calling thread is running on now, or -1 when unknown.
int CurrentCpu();

// Names the calling thread for debuggers and process tools (Linux: comm, at
// most 15 characters kept; Windows: the thread description). `name` is
// ASCII. Best effort.
void NameCurrentThread(const char* name);

// The calling thread's name as NameCurrentThread set it ("" when unknown).
std::string CurrentThreadName();

}  // namespace trainstream::platform
