// The Windows side of trainstream/platform/machine.h.
#include <malloc.h>
#include <windows.h>

#include <cstdint>
#include <string>

#include "trainstream/platform/machine.h"
#include "windows_common.h"

namespace trainstream::platform {

uint64_t PhysicalMemoryBytes() {
  MEMORYSTATUSEX status{};
  status.dwLength = sizeof(status);
  return GlobalMemoryStatusEx(&status) ? status.ullTotalPhys : 0;
}

int FileSystemSpace(const std::string& dir, uint64_t* free_bytes, uint64_t* total_bytes) {
  const std::wstring wide = internal::WidePath(dir);
  ULARGE_INTEGER available{}, total{};
  if (!GetDiskFreeSpaceExW(wide.c_str(), &available, &total, nullptr)) {
    return internal::LastErrno();
  }
  *free_bytes = available.QuadPart;
  *total_bytes = total.QuadPart;
  return 0;
}

uint64_t LockedMemoryLimit() { return UINT64_MAX; }

void ReturnFreedMemory() { _heapmin(); }

}  // namespace trainstream::platform
