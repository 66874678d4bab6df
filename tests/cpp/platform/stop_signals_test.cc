// The stop seam (trainstream/platform/stop_signals.h) on the system it was
// built for: the main loop's wait, its wake, requests handed on by a control
// handler (Deliver), and the system's own stop request (SIGTERM; Ctrl-Break).
#include "trainstream/platform/stop_signals.h"

#include <cerrno>
#include <chrono>
#include <memory>
#include <string>
#include <thread>

#include "catch_compat.h"
#include "stop_request.h"

using namespace trainstream::platform;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

TEST_CASE("one receiver per process; a second is refused until the first goes", "[stop_signals]") {
  std::unique_ptr<StopSignals> first, second;
  REQUIRE(StopSignals::Create(&first) == 0);
  CHECK(StopSignals::Create(&second) == EBUSY);
  CHECK(second == nullptr);
  first.reset();
  REQUIRE(StopSignals::Create(&second) == 0);
}

TEST_CASE("Wait times out with kNone, and Wake ends it early", "[stop_signals]") {
  std::unique_ptr<StopSignals> stop;
  REQUIRE(StopSignals::Create(&stop) == 0);
  auto t0 = Clock::now();
  CHECK(stop->Wait(100).kind == StopKind::kNone);
  CHECK(Clock::now() - t0 >= 90ms);

  std::thread waker([&] {
    std::this_thread::sleep_for(50ms);
    stop->Wake();
  });
  t0 = Clock::now();
  const StopRequest woken = stop->Wait(20000);
  waker.join();
  CHECK(woken.kind == StopKind::kNone);
  CHECK(Clock::now() - t0 < 10s);
}

TEST_CASE("delivered requests come out of Wait in order, from any thread", "[stop_signals]") {
  std::unique_ptr<StopSignals> stop;
  REQUIRE(StopSignals::Create(&stop) == 0);
  std::thread control([&] {
    stop->Deliver({StopKind::kTerminate, "service stop"});
    stop->Deliver({StopKind::kShutdown, "system shutdown"});
  });
  control.join();
  StopRequest a = stop->Wait(10000);
  // A wake may come out first as kNone; it never loses a request.
  if (a.kind == StopKind::kNone) a = stop->Wait(10000);
  CHECK(a.kind == StopKind::kTerminate);
  CHECK(a.description == "service stop");
  StopRequest b = stop->Wait(10000);
  if (b.kind == StopKind::kNone) b = stop->Wait(10000);
  CHECK(b.kind == StopKind::kShutdown);
  CHECK(b.description == "system shutdown");
}

TEST_CASE("the system's stop request (SIGTERM, Ctrl-Break) comes out as kTerminate",
          "[stop_signals]") {
  std::unique_ptr<StopSignals> stop;
  REQUIRE(StopSignals::Create(&stop) == 0);
  std::string description, why;
  if (!testing::SendTerminate(&description, &why)) TS_SKIP(why);
  StopRequest request;
  const auto deadline = Clock::now() + 10s;
  while (request.kind == StopKind::kNone && Clock::now() < deadline) request = stop->Wait(1000);
  CHECK(request.kind == StopKind::kTerminate);
  CHECK(request.description == description);
}
