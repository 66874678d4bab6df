#include "memory/budget.h"

#include <atomic>
#include <thread>
#include <vector>

#include "catch_compat.h"

using trainstream::daemon::Budget;

TEST_CASE("Budget reserves up to the limit and explains refusals", "[budget]") {
  Budget b(1000);
  REQUIRE(b.Reserve(600, "a").ok());
  REQUIRE(b.Reserve(400, "b").ok());
  CHECK(b.used() == 1000);
  CHECK(b.free() == 0);
  auto s = b.Reserve(1, "region 'x'");
  CHECK(s.code() == trainstream::StatusCode::kResourceExhausted);
  CHECK(s.message().find("asked 1 bytes") != std::string::npos);
  CHECK(s.message().find("region 'x'") != std::string::npos);
  CHECK(s.message().find("0 bytes") != std::string::npos);
  CHECK(s.message().find("1000-byte") != std::string::npos);
  b.Release(600);
  CHECK(b.used() == 400);
  auto big = b.Reserve(601, "c");
  CHECK_FALSE(big.ok());
  CHECK(big.message().find("600 bytes") != std::string::npos);
  CHECK(b.used() == 400);  // a refused reservation takes nothing
}

TEST_CASE("Budget is exact under concurrent reserve/release", "[budget]") {
  Budget b(1 << 20);
  std::vector<std::thread> threads;
  std::atomic<int> refused{0};
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 2000; ++i) {
        if (b.Reserve(1024, "t").ok()) {
          b.Release(1024);
        } else {
          refused++;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  CHECK(b.used() == 0);
  CHECK(refused.load() == 0);
}
