// What the endpoint seam needs from each system (not part of its interface):
// endpoint_linux.cc and endpoint_windows.cc define these for endpoint.cc.
#pragma once

#include <string>

namespace trainstream::platform::internal {

// Writes `contents` to a new file beside `path` that this process's user alone
// may read and write, then renames it over `path`. 0 or errno.
int ReplaceWithOwnerOnlyFile(const std::string& path, const std::string& contents);

}  // namespace trainstream::platform::internal
