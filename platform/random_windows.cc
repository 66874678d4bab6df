// The Windows side of the secrets seam (trainstream/platform/random.h).
#include <windows.h>
// bcrypt.h needs windows.h first.
#include <bcrypt.h>

#include <cerrno>

#include "trainstream/platform/random.h"

namespace trainstream::platform {

int RandomBytes(unsigned char* out, size_t n) {
  const NTSTATUS status =
      BCryptGenRandom(nullptr, out, static_cast<ULONG>(n), BCRYPT_USE_SYSTEM_PREFERRED_RNG);
  return status == 0 ? 0 : EIO;
}

}  // namespace trainstream::platform
