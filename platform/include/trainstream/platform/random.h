// The platform seam for secrets: random bytes from the system's CSPRNG, never a
// seeded PRNG, and the comparison of secrets. Session tokens, recovery tokens
// and segment names (daemon/security/token.h) and the control endpoint's secret
// (platform/endpoint.h) come from here. Two sides for the random source,
// picked by platform/CMakeLists.txt: random_linux.cc (getrandom) and
// random_windows.cc (BCryptGenRandom with the system's preferred generator);
// the rest is random.cc, shared.
#pragma once

#include <cstddef>
#include <string>

namespace trainstream::platform {

// Fills `out` with `n` random bytes. Returns 0 or an errno value (getrandom
// fails only on misuse; BCryptGenRandom's failures are EIO).
int RandomBytes(unsigned char* out, size_t n);

// `bytes` random bytes as 2 * `bytes` lowercase hex digits. 0 or errno.
int RandomHex(size_t bytes, std::string* out);

// True when `a` and `b` are equal, in a time that depends on their lengths
// only, never on where they first differ.
bool ConstantTimeEquals(const std::string& a, const std::string& b);

}  // namespace trainstream::platform
