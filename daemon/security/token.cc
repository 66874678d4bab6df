#include "security/token.h"

#include <cstdio>
#include <cstdlib>

#include "trainstream/platform/random.h"
#include "trainstream/platform/sys_call.h"

namespace trainstream::daemon {

std::string RandomHex(size_t bytes) {
  std::string out;
  if (int err = platform::RandomHex(bytes, &out); err != 0) {
    std::fprintf(stderr, "trainstreamd: %s\n",
                 platform::ErrnoText("the system's random source failed", err).c_str());
    std::abort();  // No safe fallback for secrets.
  }
  return out;
}

bool ConstantTimeEquals(const std::string& a, const std::string& b) {
  return platform::ConstantTimeEquals(a, b);
}

}  // namespace trainstream::daemon
