// The Linux side of the secrets seam (trainstream/platform/random.h): getrandom,
// as daemon/security/token.cc called it before the seam.
#include <sys/random.h>

#include <cerrno>

#include "trainstream/platform/random.h"

namespace trainstream::platform {

int RandomBytes(unsigned char* out, size_t n) {
  size_t got = 0;
  while (got < n) {
    const ssize_t r = getrandom(out + got, n - got, 0);
    if (r < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    got += static_cast<size_t>(r);
  }
  return 0;
}

}  // namespace trainstream::platform
