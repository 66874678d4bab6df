// Unguessable identifiers: session tokens and segment names come from the
// system's CSPRNG (platform/random.h: getrandom, BCryptGenRandom), never from a
// seeded PRNG.
#pragma once

#include <string>

namespace trainstream::daemon {

// `bytes` random bytes as 2*bytes lowercase hex digits. Aborts if the system
// cannot supply randomness (getrandom only fails on misuse).
std::string RandomHex(size_t bytes);

// Compares secrets in time independent of where they differ.
bool ConstantTimeEquals(const std::string& a, const std::string& b);

}  // namespace trainstream::daemon
