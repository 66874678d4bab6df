// The Linux side of the threads seam (trainstream/platform/threads.h): the
// affinity mask from sched_getaffinity, the topology from sysfs, pinning with
// pthread_setaffinity_np and names with pthread_setname_np.
#include <pthread.h>
#include <sched.h>

#include <cstdio>
#include <string>

#include "trainstream/platform/threads.h"

namespace trainstream::platform {
namespace {

// stdio, not std::ifstream: this file is also linked into trainstream._C, where
// iostreams crash (Note [No iostreams in _C], python/csrc/check.h).
bool ReadInt(const std::string& path, int* out) {
  FILE* f = std::fopen(path.c_str(), "r");
  if (f == nullptr) return false;
  const bool ok = std::fscanf(f, "%d", out) == 1;
  std::fclose(f);
  return ok;
}

}  // namespace

std::vector<int> AllowedCpus() {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  std::vector<int> cpus;
  if (sched_getaffinity(0, sizeof(allowed), &allowed) == 0) {
    for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
      if (CPU_ISSET(cpu, &allowed)) cpus.push_back(cpu);
    }
  }
  return cpus;
}

bool CoreOfCpu(int cpu, CpuCore* out) {
  const std::string base = "/sys/devices/system/cpu/cpu" + std::to_string(cpu) + "/topology/";
  int package = 0, core = 0;
  if (!ReadInt(base + "physical_package_id", &package) || !ReadInt(base + "core_id", &core)) {
    return false;
  }
  *out = CpuCore{package, core};
  return true;
}

bool PinCurrentThread(int cpu) {
  if (cpu < 0 || cpu >= CPU_SETSIZE) return false;
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  return pthread_setaffinity_np(pthread_self(), sizeof(set), &set) == 0;
}

int CurrentCpu() { return sched_getcpu(); }

void NameCurrentThread(const char* name) { pthread_setname_np(pthread_self(), name); }

std::string CurrentThreadName() {
  char name[16] = {};
  if (pthread_getname_np(pthread_self(), name, sizeof(name)) != 0) return "";
  return name;
}

}  // namespace trainstream::platform
