#include "recovery/owner.h"

#include <openssl/evp.h>

#include <cstdio>
#include <cstdlib>

#include "trainstream/platform/process_watcher.h"

namespace trainstream::daemon {

OwnerProof ProofOf(const std::string& recovery_token) {
  OwnerProof out{};
  unsigned int n = 0;
  // One-shot EVP digest: fails only when OpenSSL itself is broken.
  if (EVP_Digest(recovery_token.data(), recovery_token.size(), out.data(), &n, EVP_sha256(),
                 nullptr) != 1 ||
      n != out.size()) {
    std::fprintf(stderr, "trainstreamd: SHA-256 from OpenSSL failed\n");
    std::abort();  // No safe fallback for an ownership proof.
  }
  return out;
}

uint64_t ProcessStartTime(pid_t pid) { return platform::ProcessStartTime(pid); }

bool ProcessAlive(pid_t pid, uint64_t start) {
  const uint64_t now = ProcessStartTime(pid);
  return now != 0 && now == start;
}

}  // namespace trainstream::daemon
