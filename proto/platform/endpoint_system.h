// What the endpoint seam needs from each system (not part of its interface):
// endpoint_linux.cc and endpoint_windows.cc define these for endpoint.cc.
#pragma once

#include <cstddef>
#include <string>

namespace trainstream::platform::internal {

// Fills `out` with `n` bytes from the system's random source. 0 or errno.
int RandomBytes(unsigned char* out, size_t n);

// Writes `contents` to a new file beside `path` that this process's user alone
// may read and write, then renames it over `path`. 0 or errno.
int ReplaceWithOwnerOnlyFile(const std::string& path, const std::string& contents);

}  // namespace trainstream::platform::internal
