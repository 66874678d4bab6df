// The wire ring between two processes: a child produces, the parent consumes
// (blocking in the futex), over a MAP_SHARED mapping, as a client and the
// daemon do through a session's control segment.
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>

#include "catch_compat.h"
#include "trainstream/wire/ring.h"
#include "trainstream/wire/session_control.h"

using namespace trainstream::wire;

TEST_CASE("Ring push/pop across fork() with futex wake", "[ring]") {
  constexpr uint64_t kCapacity = 64;
  constexpr uint64_t kRecords = 20000;  // > capacity: exercises wrap-around and full-ring retries
  const size_t bytes = RingBytes(kCapacity, sizeof(CommandRecord));
  void* mem = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  REQUIRE(mem != MAP_FAILED);
  RingView ring = RingView::Initialize(mem, kCapacity, sizeof(CommandRecord));
  REQUIRE(ring.valid());

  pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    RingView producer(mem);
    for (uint64_t i = 0; i < kRecords; ++i) {
      CommandRecord r{};
      r.opcode = Opcode::kGradReady;
      r.seq = i;
      r.param_id = i * 3;
      while (!producer.TryPush(&r)) {
      }
      // Pause now and then so the parent really sleeps in the futex.
      if (i % 1000 == 0) usleep(2000);
    }
    _exit(0);
  }
  uint64_t next = 0;
  bool in_order = true;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (next < kRecords && std::chrono::steady_clock::now() < deadline) {
    CommandRecord r{};
    if (!ring.Pop(&r, 100000000)) continue;  // 100 ms timeout, then retry
    in_order =
        in_order && r.seq == next && r.param_id == next * 3 && r.opcode == Opcode::kGradReady;
    ++next;
  }
  int status = 0;
  waitpid(child, &status, 0);
  CHECK(WIFEXITED(status));
  CHECK(next == kRecords);
  CHECK(in_order);
  CHECK(ring.size() == 0);
  munmap(mem, bytes);
}

TEST_CASE("A blocked consumer wakes promptly on push and on WakeConsumer", "[ring]") {
  const size_t bytes = RingBytes(8, sizeof(CompletionRecord));
  void* mem = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  REQUIRE(mem != MAP_FAILED);
  RingView ring = RingView::Initialize(mem, 8, sizeof(CompletionRecord));
  pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    usleep(50000);
    CompletionRecord r{};
    r.opcode = Opcode::kParamReady;
    r.seq = 99;
    RingView(mem).TryPush(&r);
    _exit(0);
  }
  CompletionRecord r{};
  const auto t0 = std::chrono::steady_clock::now();
  bool got = false;
  while (!got && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(30)) {
    got = ring.Pop(&r, 5'000'000'000);
  }
  waitpid(child, nullptr, 0);
  REQUIRE(got);
  CHECK(r.seq == 99);
  // Woken by the push, not by the 5 s timeout.
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(4));
  munmap(mem, bytes);
}

// Regression: the peer can write the shared header. A view keeps the capacity and
// record size it saw when it was made, so a corrupted header cannot turn into an
// out-of-bounds access on this side.
TEST_CASE("A ring view ignores a peer's later writes to capacity and record size", "[ring]") {
  constexpr uint64_t kCapacity = 8;
  const size_t bytes = RingBytes(kCapacity, sizeof(CommandRecord));
  void* mem = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  REQUIRE(mem != MAP_FAILED);
  RingView::Initialize(mem, kCapacity, sizeof(CommandRecord));
  RingView view(mem);
  auto* header = static_cast<RingHeader*>(mem);
  header->capacity = uint64_t{1} << 40;  // what a buggy or hostile client might write
  header->record_size = 1u << 20;

  CommandRecord rec{};
  int pushed = 0;
  while (view.TryPush(&rec)) ++pushed;
  CHECK(pushed == static_cast<int>(kCapacity));  // still bounded by the original capacity
  CommandRecord out{};
  int popped = 0;
  while (view.TryPop(&out)) ++popped;
  CHECK(popped == pushed);
  munmap(mem, bytes);
}
