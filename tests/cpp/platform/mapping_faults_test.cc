// The wake-ups of trainstream/platform/mapping_faults.h (the session reaper's
// and the fault handler's), on the system it was built for. The fault
// handler itself is daemon_client_memory_guard_test's (Linux: a real SIGBUS).
#include "trainstream/platform/mapping_faults.h"

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>

#include "catch_compat.h"

using namespace trainstream::platform;
using namespace std::chrono_literals;

TEST_CASE("a set event ends a wait at once, until it is cleared", "[mapping_faults]") {
  std::unique_ptr<WakeEvent> a, b;
  REQUIRE(WakeEvent::Create(&a) == 0);
  REQUIRE(WakeEvent::Create(&b) == 0);
  a->Set();
  a->Set();  // merges with the first
  CHECK(WakeEvent::WaitEither(a.get(), b.get()) == 0);
  CHECK(WakeEvent::WaitEither(a.get(), nullptr) == 0);  // not cleared by a wait
  a->Clear();
  // Now only a Set from another thread ends the wait; either event does.
  for (WakeEvent* which : {a.get(), b.get()}) {
    std::atomic<bool> woke{false};
    std::thread waiter([&] {
      CHECK(WakeEvent::WaitEither(a.get(), b.get()) == 0);
      woke.store(true);
    });
    std::this_thread::sleep_for(50ms);
    CHECK_FALSE(woke.load());
    which->Set();
    waiter.join();
    CHECK(woke.load());
    which->Clear();
  }
}

TEST_CASE("the fault handler installs once", "[mapping_faults]") {
  std::string why;
  auto handler = [](uintptr_t) { return false; };
  CHECK(InstallMappingFaultHandler(handler, &why) == 0);
  CHECK(InstallMappingFaultHandler(handler, &why) == 0);
  CHECK(why.empty());
}
