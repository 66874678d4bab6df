// PlaceExtent and ExtentFree (trainstream/wire/grad_pool.h): extents never
// wrap, never overlap an unreleased byte, and the arithmetic holds near 2^64.
#include <cstdint>
#include <deque>
#include <random>
#include <utility>

#include "catch_compat.h"
#include "trainstream/wire/grad_pool.h"

using trainstream::wire::ExtentFree;
using trainstream::wire::PlaceExtent;

TEST_CASE("PlaceExtent keeps an extent inside one lap", "[grad_pool]") {
  CHECK(PlaceExtent(0, 100, 1000) == 0);
  CHECK(PlaceExtent(900, 100, 1000) == 900);
  CHECK(PlaceExtent(901, 100, 1000) == 1000);
  CHECK(PlaceExtent(2500, 600, 1000) == 3000);
  CHECK(PlaceExtent(3000, 1000, 1000) == 3000);
}

TEST_CASE("ExtentFree: an empty pool holds its largest extent", "[grad_pool]") {
  // Padding plus the extent exceed C, but nothing is in flight.
  CHECK(ExtentFree(2000, 1000, 1500, 1500, 1000));
  CHECK_FALSE(ExtentFree(2000, 1000, 1400, 1500, 1000));
  CHECK_FALSE(ExtentFree(0, 1001, 0, 0, 1000));
}

TEST_CASE("ExtentFree: the window ends one lap past released", "[grad_pool]") {
  CHECK(ExtentFree(1000, 500, 500, 1000, 1000));
  CHECK_FALSE(ExtentFree(1000, 501, 500, 1000, 1000));
  CHECK_FALSE(ExtentFree(100, 10, 500, 1000, 1000));  // below released
}

TEST_CASE("ExtentFree near 2^64", "[grad_pool]") {
  const uint64_t top = UINT64_MAX - 63;
  CHECK_FALSE(ExtentFree(top, 128, top - 64, top, 4096));
  CHECK(ExtentFree(top - 128, 64, top - 256, top - 128, 4096));
  CHECK_FALSE(ExtentFree(UINT64_MAX, 1, UINT64_MAX - 10, 5, 4096));
}

TEST_CASE("random claims and releases never overlap in flight", "[grad_pool]") {
  std::mt19937_64 rng(7);
  for (int round = 0; round < 50; ++round) {
    const uint64_t cap = 64 * (1 + rng() % 64);
    std::deque<std::pair<uint64_t, uint64_t>> in_flight;  // claim order
    uint64_t claim = (rng() % 2) ? 0 : UINT64_MAX / 2, released = claim;
    for (int op = 0; op < 2000; ++op) {
      if (!in_flight.empty() && rng() % 3 == 0) {
        in_flight.pop_front();
        released = in_flight.empty() ? claim : in_flight.front().first;
        continue;
      }
      const uint64_t len = 64 * (1 + rng() % (cap / 64));
      const uint64_t pos = PlaceExtent(claim, len, cap);
      if (!ExtentFree(pos, len, released, claim, cap)) continue;
      REQUIRE(pos % cap + len <= cap);
      for (const auto& [p, l] : in_flight) {  // disjoint modulo C
        const uint64_t a = p % cap, b = pos % cap;
        REQUIRE((a + l <= b || b + len <= a));
      }
      if (in_flight.empty()) released = pos;
      in_flight.emplace_back(pos, len);
      claim = pos + len;
    }
  }
}
