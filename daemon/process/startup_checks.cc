#include "process/startup_checks.h"

#include <cerrno>
#include <cstdint>

#include "memory/budget.h"
#include "memory/shm_segment.h"
#include "process/config.h"
#include "trainstream/human_bytes.h"
#include "trainstream/platform/files.h"
#include "trainstream/platform/machine.h"
#include "trainstream/platform/sys_call.h"
#include "trainstream/platform/user.h"

namespace trainstream::daemon {
namespace {
std::string CeilGiB(uint64_t bytes) {
  return std::to_string((bytes + (1ull << 30) - 1) >> 30) + "G";
}
}  // namespace

StartupFacts GatherStartupFacts(const std::string& shm_dir, uint64_t budget, bool lock_memory) {
  StartupFacts f;
  f.shm_dir = shm_dir;
  f.budget = budget;
  f.lock_memory = lock_memory;
  f.privileged = platform::RunsPrivileged();
  f.memlock_limit = platform::LockedMemoryLimit();
  f.ram_bytes = PhysicalRamBytes();
  return f;
}

StartupReport CheckStartup(const StartupFacts& f) {
  StartupReport r;
  if (const int err = platform::CheckWritableDirectory(f.shm_dir); err == ENOTDIR) {
    r.error = "shm directory " + f.shm_dir + " is not a directory";
    return r;
  } else if (err == EACCES || err == EPERM || err == EROFS) {
    r.error = platform::ErrnoText(
        "shm directory " + f.shm_dir + " is not writable by " + platform::DescribeCurrentUser(),
        err);
    return r;
  } else if (err != 0) {
    r.error = platform::ErrnoText("shm directory " + f.shm_dir, err) +
              " (create it, or choose another with --shm-dir / shm_dir)";
    return r;
  }
  if (f.budget == 0) {
    r.error = "the memory budget is 0 bytes; set --budget (e.g. 50% or 64G)";
    return r;
  }
  uint64_t free_bytes = 0, total_bytes = 0;
  if (FilesystemSpace(f.shm_dir, &free_bytes, &total_bytes)) {
    if (total_bytes < f.budget) {
      r.warnings.push_back(
          "shm directory " + f.shm_dir + " holds " + HumanBytes(total_bytes) +
          ", less than the budget of " + HumanBytes(f.budget) +
          ": allocations will fail before the budget is reached. Fix: `mount -o remount,size=" +
          CeilGiB(f.budget) + " " + f.shm_dir +
          "` (and the size= option in /etc/fstab), or lower --budget");
    } else if (free_bytes < f.budget) {
      r.warnings.push_back("shm directory " + f.shm_dir + " has only " + HumanBytes(free_bytes) +
                           " free of " + HumanBytes(total_bytes) + " (budget " +
                           HumanBytes(f.budget) +
                           "): other files use it (after a crash or a restart these include the "
                           "optimizer state this daemon adopts next: leave its socket's "
                           "trainstream-* files alone); remove stale ones or lower --budget");
    }
  }
  if (f.ram_bytes != 0 && f.budget > f.ram_bytes) {
    r.warnings.push_back("the budget of " + HumanBytes(f.budget) + " exceeds physical RAM (" +
                         HumanBytes(f.ram_bytes) +
                         "): the machine will swap or OOM; lower --budget (e.g. 50%)");
  }
  if (f.lock_memory && !f.privileged && f.memlock_limit < f.budget) {
    r.warnings.push_back(
        "RLIMIT_MEMLOCK is " + HumanBytes(f.memlock_limit) + ", below the budget of " +
        HumanBytes(f.budget) +
        ": segments beyond it stay unpinned. Fix: `LimitMEMLOCK=infinity` in the systemd unit, "
        "`ulimit -l unlimited` before starting the daemon, or `<user> - memlock unlimited` in "
        "/etc/security/limits.conf");
  }
  return r;
}

}  // namespace trainstream::daemon
