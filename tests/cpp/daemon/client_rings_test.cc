// The daemon's ring endpoints against a client that plays by the rules and one
// that does not (Note [Rings a client can write], daemon/planes/client_rings.h).
#include "planes/client_rings.h"

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "catch_compat.h"
#include "trainstream/wire/ring.h"

using namespace trainstream::daemon;
using trainstream::wire::CommandRecord;
using trainstream::wire::CompletionRecord;
using trainstream::wire::Opcode;
using trainstream::wire::RingBytes;
using trainstream::wire::RingHeader;
using trainstream::wire::RingView;


namespace {

constexpr uint64_t kCapacity = 8;

struct Ring {
  explicit Ring(uint32_t record_size) : memory(RingBytes(kCapacity, record_size) / 8 + 1) {
    client = RingView::Initialize(memory.data(), kCapacity, record_size);
  }
  RingHeader* header() { return reinterpret_cast<RingHeader*>(memory.data()); }
  std::vector<uint64_t> memory;
  RingView client;
};

}  // namespace

TEST_CASE("the consumer takes what a client pushes, across wrap-around", "[client_rings]") {
  Ring ring(sizeof(CommandRecord));
  CommandConsumer daemon_end(ring.header(), kCapacity);
  CommandRecord rec{}, got{};
  for (uint64_t i = 0; i < 5 * kCapacity; ++i) {
    rec.seq = i;
    REQUIRE(ring.client.TryPush(&rec));
    REQUIRE(daemon_end.TryPop(&got) == RingResult::kOk);
    CHECK(got.seq == i);
  }
  CHECK(daemon_end.TryPop(&got) == RingResult::kEmpty);
  CHECK(daemon_end.Pop(&got, 1'000'000) == RingResult::kEmpty);
}

TEST_CASE("a tail pushed past the capacity is corrupt, not a replay", "[client_rings]") {
  Ring ring(sizeof(CommandRecord));
  CommandConsumer daemon_end(ring.header(), kCapacity);
  CommandRecord got{};
  ring.header()->tail.store(uint64_t{1} << 40);
  CHECK(daemon_end.TryPop(&got) == RingResult::kCorrupt);
  CHECK(daemon_end.error().find("command ring corrupt") != std::string::npos);
  // Corrupt for good: putting the tail back does not make the ring usable again.
  ring.header()->tail.store(0);
  CHECK(daemon_end.TryPop(&got) == RingResult::kCorrupt);
}

TEST_CASE("the consumer ignores a head the client rewrites", "[client_rings]") {
  Ring ring(sizeof(CommandRecord));
  CommandConsumer daemon_end(ring.header(), kCapacity);
  CommandRecord rec{}, got{};
  rec.seq = 7;
  REQUIRE(ring.client.TryPush(&rec));
  ring.header()->head.store(12345);  // the daemon owns head; the client's write is ignored
  REQUIRE(daemon_end.TryPop(&got) == RingResult::kOk);
  CHECK(got.seq == 7);
  CHECK(ring.header()->head.load() == 1);
}

TEST_CASE("the producer fills, reports full, and detects a head moved ahead", "[client_rings]") {
  Ring ring(sizeof(CompletionRecord));
  CompletionProducer daemon_end(ring.header(), kCapacity);
  CompletionRecord rec{}, got{};
  for (uint64_t i = 0; i < kCapacity; ++i) {
    rec.seq = i;
    REQUIRE(daemon_end.TryPush(rec) == RingResult::kOk);
  }
  CHECK(daemon_end.TryPush(rec) == RingResult::kFull);
  REQUIRE(ring.client.TryPop(&got));
  CHECK(got.seq == 0);
  CHECK(daemon_end.TryPush(rec) == RingResult::kOk);
  // A head beyond the tail: "tail - head" would wrap to a huge "used" count.
  ring.header()->head.store(ring.header()->tail.load() + 3);
  CHECK(daemon_end.TryPush(rec) == RingResult::kCorrupt);
  CHECK(daemon_end.error().find("completion ring corrupt") != std::string::npos);
}

TEST_CASE("the producer ignores a tail the client rewrites", "[client_rings]") {
  Ring ring(sizeof(CompletionRecord));
  CompletionProducer daemon_end(ring.header(), kCapacity);
  CompletionRecord rec{}, got{};
  rec.seq = 1;
  REQUIRE(daemon_end.TryPush(rec) == RingResult::kOk);
  ring.header()->tail.store(999);  // ours: overwritten by the next push
  rec.seq = 2;
  REQUIRE(daemon_end.TryPush(rec) == RingResult::kOk);
  CHECK(ring.header()->tail.load() == 2);
  REQUIRE(ring.client.TryPop(&got));
  CHECK(got.seq == 1);
  REQUIRE(ring.client.TryPop(&got));
  CHECK(got.seq == 2);
}

TEST_CASE("WaitForAnyRecord wakes for a push on any ring and times out otherwise",
          "[client_rings]") {
  using Clock = std::chrono::steady_clock;
  Ring a(sizeof(CommandRecord)), b(sizeof(CommandRecord));
  CommandConsumer ca(a.header(), kCapacity), cb(b.header(), kCapacity);
  CommandConsumer* rings[] = {&ca, &cb};
  auto t0 = Clock::now();
  const bool waited = WaitForAnyRecord(rings, 2, 30'000'000);  // nothing comes: 30 ms
  if (!waited) {
    TS_SKIP("futex_waitv is not available here (kernel before 5.16, or a seccomp filter)");
  }
  CHECK(Clock::now() - t0 >= std::chrono::milliseconds(25));
  CHECK(a.header()->sleepers.load() == 0);  // every sleeper count given back
  CHECK(b.header()->sleepers.load() == 0);

  // A push on the second ring ends the wait long before its 10 s.
  std::thread client([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    CommandRecord rec{};
    rec.opcode = Opcode::kSync;
    REQUIRE(b.client.TryPush(&rec));
  });
  t0 = Clock::now();
  CHECK(WaitForAnyRecord(rings, 2, 10'000'000'000));
  CHECK(Clock::now() - t0 < std::chrono::seconds(5));
  client.join();
  CommandRecord got{};
  CHECK(cb.TryPop(&got) == RingResult::kOk);
  CHECK(got.opcode == Opcode::kSync);
  // A ring that already holds a record is not slept on at all.
  REQUIRE(a.client.TryPush(&got));
  t0 = Clock::now();
  CHECK(WaitForAnyRecord(rings, 2, 10'000'000'000));
  CHECK(Clock::now() - t0 < std::chrono::seconds(5));
}
