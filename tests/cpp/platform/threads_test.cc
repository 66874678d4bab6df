// The threads seam (trainstream/platform/threads.h) on the system it was built
// for: built and run on Linux and, cross-built, under wine64 (docs/windows.md).
#include "trainstream/platform/threads.h"

#include <algorithm>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "catch_compat.h"

using namespace trainstream::platform;

TEST_CASE("the allowed CPUs are listed once each, ascending", "[threads]") {
  const std::vector<int> cpus = AllowedCpus();
  REQUIRE(!cpus.empty());
  CHECK(std::is_sorted(cpus.begin(), cpus.end()));
  CHECK(std::adjacent_find(cpus.begin(), cpus.end()) == cpus.end());
  CHECK(cpus.front() >= 0);
}

TEST_CASE("each allowed CPU has a core, and no core has more CPUs than exist", "[threads]") {
  const std::vector<int> cpus = AllowedCpus();
  std::set<std::pair<int, int>> cores;
  for (int cpu : cpus) {
    CpuCore core;
    // Both systems describe every CPU a process may use; a CPU without a core
    // means the seam read the topology wrong.
    REQUIRE(CoreOfCpu(cpu, &core));
    CHECK(core.package >= 0);
    CHECK(core.core >= 0);
    cores.insert({core.package, core.core});
  }
  CHECK(!cores.empty());
  CHECK(cores.size() <= cpus.size());
  CpuCore unused;
  CHECK(!CoreOfCpu(-1, &unused));
}

TEST_CASE("a pinned thread runs on its CPU", "[threads]") {
  for (int cpu : AllowedCpus()) {
    bool pinned = false;
    int ran_on = -2;
    std::thread([&] {
      // Both systems move the thread off a CPU its new mask excludes before
      // the call returns.
      pinned = PinCurrentThread(cpu);
      ran_on = CurrentCpu();
    }).join();
    CHECK(pinned);
    CHECK(ran_on == cpu);
  }
  CHECK(!PinCurrentThread(-1));
}

TEST_CASE("a thread's name reads back as it was set", "[threads]") {
  std::string name;
  std::thread([&] {
    NameCurrentThread("ts-adamw-7");
    name = CurrentThreadName();
  }).join();
  CHECK(name == "ts-adamw-7");
}
