// The liveness seam (trainstream/platform/process_watcher.h) on the system it
// was built for, with real child processes killed the way a client dies.
#include "trainstream/platform/process_watcher.h"

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "catch_compat.h"
#include "child_process.h"
#include "trainstream/platform/this_process.h"

using namespace trainstream::platform;
using testing::ChildProcess;
using namespace std::chrono_literals;

namespace {

// The keys on_exit was called with, in order, and a wait for the next one.
struct Exits {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<uint64_t> keys;  // Guarded by mu

  void Add(uint64_t key) {
    std::lock_guard<std::mutex> lock(mu);
    keys.push_back(key);
    cv.notify_all();
  }
  // True when `n` exits were reported within `timeout`.
  bool WaitFor(size_t n, std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, timeout, [&] { return keys.size() >= n; });
  }
  std::vector<uint64_t> Seen() {
    std::lock_guard<std::mutex> lock(mu);
    return keys;
  }
};

}  // namespace

TEST_CASE("a killed process is reported once, under its key", "[process_watcher]") {
  Exits exits;
  ProcessWatcher watcher([&](uint64_t key) { exits.Add(key); });
  ChildProcess a, b;
  REQUIRE(a.pid() != 0);
  REQUIRE(b.pid() != 0);
  REQUIRE(watcher.Watch(11, a.pid()));
  REQUIRE(watcher.Watch(22, b.pid()));
  a.Kill();
  REQUIRE(exits.WaitFor(1, 10s));
  CHECK(exits.Seen() == std::vector<uint64_t>{11});
  b.Kill();
  REQUIRE(exits.WaitFor(2, 10s));
  // Nothing more: each watch reports once.
  CHECK(!exits.WaitFor(3, 200ms));
  CHECK(exits.Seen() == std::vector<uint64_t>{11, 22});
}

TEST_CASE("a process that does not exist cannot be watched", "[process_watcher]") {
  ProcessWatcher watcher([](uint64_t) {});
  CHECK(!watcher.Watch(1, testing::UnusedPid()));
  CHECK(!watcher.Watch(2, -1));
}

TEST_CASE("an unwatched or replaced watch reports nothing", "[process_watcher]") {
  Exits exits;
  ProcessWatcher watcher([&](uint64_t key) { exits.Add(key); });
  ChildProcess a, b, c;
  REQUIRE(watcher.Watch(1, a.pid()));
  watcher.Unwatch(1);
  a.Kill();
  // Key 2 first watches b, then c: only c's exit counts for it.
  REQUIRE(watcher.Watch(2, b.pid()));
  REQUIRE(watcher.Watch(2, c.pid()));
  b.Kill();
  CHECK(!exits.WaitFor(1, 300ms));
  c.Kill();
  REQUIRE(exits.WaitFor(1, 10s));
  CHECK(exits.Seen() == std::vector<uint64_t>{2});
  watcher.Unwatch(7);  // never watched: nothing happens
}

TEST_CASE("on_exit may unwatch, and the watcher stops with watches left", "[process_watcher]") {
  Exits exits;
  ProcessWatcher* w = nullptr;  // set before anything is watched
  auto watcher = std::make_unique<ProcessWatcher>([&](uint64_t key) {
    w->Unwatch(key);      // already gone: the callback may still ask
    w->Unwatch(key + 1);  // another session's watch
    exits.Add(key);
  });
  w = watcher.get();
  ChildProcess a, b, c;
  REQUIRE(w->Watch(1, a.pid()));
  REQUIRE(w->Watch(2, b.pid()));
  REQUIRE(w->Watch(5, c.pid()));  // still watched when the watcher goes
  a.Kill();
  REQUIRE(exits.WaitFor(1, 10s));
  b.Kill();  // unwatched by the callback for key 1
  CHECK(!exits.WaitFor(2, 300ms));
  watcher.reset();
  CHECK(exits.Seen() == std::vector<uint64_t>{1});
}

TEST_CASE("a process's start time names it while it runs, and is 0 after", "[process_watcher]") {
  const uint64_t self = ProcessStartTime(CurrentProcessId());
  CHECK(self != 0);
  CHECK(ProcessStartTime(CurrentProcessId()) == self);  // stable
  CHECK(ProcessStartTime(testing::UnusedPid()) == 0);
  CHECK(ProcessStartTime(-1) == 0);
  ChildProcess child;
  REQUIRE(child.pid() != 0);
  const uint64_t start = ProcessStartTime(child.pid());
  CHECK(start != 0);
  CHECK(start >= self);  // started after this test
  child.Kill();
  // Killed but not reaped (a Linux zombie; a Windows handle still open): 0.
  uint64_t after = start;
  for (int i = 0; i < 500 && after != 0; ++i) {
    std::this_thread::sleep_for(10ms);
    after = ProcessStartTime(child.pid());
  }
  CHECK(after == 0);
}
