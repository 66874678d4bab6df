// Startup checks (run before the daemon binds its socket): the shm directory
// and the memlock limit against the budget. What cannot work is refused; what
// merely limits the daemon is a warning that says exactly what to change.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace trainstream::daemon {

struct StartupFacts {
  std::string shm_dir;
  uint64_t budget = 0;
  bool lock_memory = true;
  bool privileged = false;     // euid 0 (CAP_IPC_LOCK): memlock does not apply
  uint64_t memlock_limit = 0;  // RLIMIT_MEMLOCK soft limit; UINT64_MAX for unlimited
  uint64_t ram_bytes = 0;
};

struct StartupReport {
  std::string error;                  // non-empty: refuse to start
  std::vector<std::string> warnings;  // each one names the fix
};

// Reads the facts of this process and machine.
StartupFacts GatherStartupFacts(const std::string& shm_dir, uint64_t budget, bool lock_memory);

// Pure check of `facts` (plus statvfs/access of facts.shm_dir).
StartupReport CheckStartup(const StartupFacts& facts);

}  // namespace trainstream::daemon
