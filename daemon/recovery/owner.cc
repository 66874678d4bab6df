#include "recovery/owner.h"

#include <openssl/evp.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

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

uint64_t ProcessStartTime(pid_t pid) {
  if (pid <= 0) return 0;
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  // "pid (comm) state ppid ...": comm may hold spaces and ')', so fields count
  // from the last ')'. After it come field 3 (state) .. field 22 (starttime).
  const size_t close = text.rfind(')');
  if (close == std::string::npos) return 0;
  std::istringstream fields(text.substr(close + 1));
  std::string field;
  for (int i = 3; i <= 22; ++i) {
    if (!(fields >> field)) return 0;
    if (i == 3 && (field == "Z" || field == "X")) return 0;  // exited, not yet reaped
  }
  return std::strtoull(field.c_str(), nullptr, 10);
}

bool ProcessAlive(pid_t pid, uint64_t start) {
  const uint64_t now = ProcessStartTime(pid);
  return now != 0 && now == start;
}

}  // namespace trainstream::daemon
