// The Linux side of trainstream/platform/machine.h.
#include <malloc.h>
#include <sys/resource.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <string>

#include "trainstream/platform/machine.h"

namespace trainstream::platform {

uint64_t PhysicalMemoryBytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return 0;
  return static_cast<uint64_t>(pages) * static_cast<uint64_t>(page);
}

int FileSystemSpace(const std::string& dir, uint64_t* free_bytes, uint64_t* total_bytes) {
  struct statvfs st {};
  if (statvfs(dir.c_str(), &st) != 0) return errno;
  *free_bytes = static_cast<uint64_t>(st.f_bavail) * st.f_frsize;
  *total_bytes = static_cast<uint64_t>(st.f_blocks) * st.f_frsize;
  return 0;
}

uint64_t LockedMemoryLimit() {
  struct rlimit rl {};
  if (getrlimit(RLIMIT_MEMLOCK, &rl) != 0) return 0;
  return rl.rlim_cur == RLIM_INFINITY ? UINT64_MAX : static_cast<uint64_t>(rl.rlim_cur);
}

void ReturnFreedMemory() { malloc_trim(0); }

}  // namespace trainstream::platform
