// GradientPool (planes/grad_pool.h): every rule of Note [A pool extent a client
// names], the release of the finished prefix, the header it publishes, and an
// invariant over random hostile extents.
#include "planes/grad_pool.h"

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "catch_compat.h"

using trainstream::StatusCode;
using trainstream::daemon::GradientPool;
using trainstream::optimizer::GradRef;
namespace wire = trainstream::wire;

namespace {

constexpr uint64_t kCap = 4096;

struct Staging {
  std::vector<char> bytes = std::vector<char>(wire::kGradPoolOffset + kCap + 4096);
  char* base() { return bytes.data(); }
  wire::GradPoolHeader* header() {
    return reinterpret_cast<wire::GradPoolHeader*>(base() + wire::kGradPoolHeaderOffset);
  }
};

std::string Why(GradientPool& pool, uint64_t id, uint64_t pos, uint64_t len, uint64_t want) {
  GradRef ref;
  trainstream::Status st = pool.Accept(id, pos, len, want, &ref);
  return st.ok() ? "" : st.message();
}

}  // namespace

TEST_CASE("a fresh pool writes its header", "[grad_pool]") {
  Staging s;
  GradientPool pool(s.base(), wire::kGradPoolOffset, kCap, true);
  CHECK(s.header()->magic == wire::kGradPoolMagic);
  CHECK(s.header()->capacity == kCap);
  CHECK(s.header()->pool_offset == wire::kGradPoolOffset);
}

TEST_CASE("Accept refuses each broken rule and keeps going", "[grad_pool]") {
  Staging s;
  GradientPool pool(s.base(), wire::kGradPoolOffset, kCap, true);
  CHECK(Why(pool, 1, 0, 64, 128).find("its gradient has 128") != std::string::npos);
  CHECK(Why(pool, 1, 0, 8192, 8192).find("does not fit") != std::string::npos);
  CHECK(Why(pool, 1, 0, 0, 0).find("does not fit") != std::string::npos);
  CHECK(Why(pool, 1, 32, 64, 64).find("aligned") != std::string::npos);
  CHECK(Why(pool, 1, UINT64_MAX - 63, 128, 128).find("overflows") != std::string::npos);
  CHECK(Why(pool, 1, kCap - 64, 128, 128).find("wraps") != std::string::npos);
  GradRef ref;
  REQUIRE(pool.Accept(1, 1024, 1024, 1024, &ref).ok());
  CHECK(ref.data == s.base() + wire::kGradPoolOffset + 1024);
  CHECK(ref.record_offset == wire::kGradPoolOffset + 1024);
  CHECK(Why(pool, 1, 2048, 64, 64).find("still in flight") != std::string::npos);
  CHECK(Why(pool, 2, 1024, 64, 64).find("starts before") != std::string::npos);
  CHECK(Why(pool, 2, 1536, 64, 64).find("starts before") != std::string::npos);
  // The window ends one lap past released (1024): [4096, 5120) fits, 5184 does not.
  CHECK(Why(pool, 2, kCap + 1024 - 64, 128, 128).find("overwrites") != std::string::npos);
  REQUIRE(pool.Accept(2, kCap, 1024, 1024, &ref).ok());
  CHECK(ref.data == s.base() + wire::kGradPoolOffset);  // position 4096 is offset 0
  CHECK(pool.in_flight() == 2);
}

TEST_CASE("Release frees the finished prefix and wakes the client", "[grad_pool]") {
  Staging s;
  GradientPool pool(s.base(), wire::kGradPoolOffset, kCap, true);
  GradRef ref;
  REQUIRE(pool.Accept(1, 0, 1024, 1024, &ref).ok());
  REQUIRE(pool.Accept(2, 1024, 512, 512, &ref).ok());
  REQUIRE(pool.Accept(3, 1536, 512, 512, &ref).ok());
  const uint32_t seq0 = s.header()->release_seq.load();
  pool.Release(2);  // out of order: nothing at the front is free
  CHECK(s.header()->released.load() == 0);
  CHECK(s.header()->release_seq.load() == seq0);
  s.header()->waiters.store(1);  // a sleeping client gets a futex wake (no one sleeps here)
  pool.Release(1);
  CHECK(s.header()->released.load() == 1536);
  CHECK(s.header()->release_seq.load() == seq0 + 1);
  pool.Release(7);  // nothing in flight for it: ignored
  pool.Release(3);
  CHECK(s.header()->released.load() == 2048);
  CHECK(pool.in_flight() == 0);
  // Empty: any aligned extent that does not wrap is taken, even behind.
  REQUIRE(pool.Accept(1, 64, 64, 64, &ref).ok());
  CHECK(pool.released() == 64);
}

TEST_CASE("random hostile extents never overlap one in flight", "[grad_pool]") {
  Staging s;
  GradientPool pool(s.base(), wire::kGradPoolOffset, kCap, true);
  std::mt19937_64 rng(11);
  struct Live {
    uint64_t id, offset, len;
  };
  std::vector<Live> live;
  for (int op = 0; op < 100000; ++op) {
    if (!live.empty() && rng() % 3 == 0) {
      const size_t k = rng() % live.size();
      pool.Release(live[k].id);
      live.erase(live.begin() + static_cast<long>(k));
      continue;
    }
    const uint64_t id = rng() % 64;
    const uint64_t len = rng() % 2 ? 64 * (1 + rng() % 32) : rng() % 5000;
    uint64_t pos = rng() % 4 == 0 ? rng() : pool.released() + 64 * (rng() % 80);
    if (rng() % 8 == 0) pos = UINT64_MAX - rng() % 4096;
    GradRef ref;
    if (!pool.Accept(id, pos, len, len, &ref).ok()) continue;
    const uint64_t off = ref.record_offset - wire::kGradPoolOffset;
    REQUIRE(off + len <= kCap);
    for (const Live& l : live) {
      REQUIRE(l.id != id);
      REQUIRE((l.offset + l.len <= off || off + len <= l.offset));
    }
    live.push_back({id, off, len});
  }
  REQUIRE(pool.in_flight() == live.size());
}
