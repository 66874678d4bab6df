// What the machine offers and who this process is (trainstream/platform/
// machine.h, user.h), checked against what the system reports through another
// door: std::filesystem's space(), and the environment.
#include <cerrno>
#include <cstdint>
#include <filesystem>
#include <string>

#include "catch_compat.h"
#include "trainstream/platform/machine.h"
#include "trainstream/platform/user.h"

namespace fs = std::filesystem;
using namespace trainstream::platform;

TEST_CASE("physical memory is reported, and is more than a gigabyte", "[machine]") {
  const uint64_t bytes = PhysicalMemoryBytes();
  CHECK(bytes > (uint64_t{1} << 30));
  CHECK(bytes % 4096 == 0);
}

TEST_CASE("file-system space agrees with std::filesystem::space", "[machine]") {
  const std::string dir = fs::temp_directory_path().u8string();
  uint64_t free_bytes = 0, total_bytes = 0;
  REQUIRE(FileSystemSpace(dir, &free_bytes, &total_bytes) == 0);
  CHECK(total_bytes > 0);
  CHECK(free_bytes <= total_bytes);
  const fs::space_info info = fs::space(fs::u8path(dir));
  CHECK(total_bytes == info.capacity);
  // Other writers may run between the two calls: within 64 MiB.
  const uint64_t other = info.available;
  CHECK((free_bytes > other ? free_bytes - other : other - free_bytes) < (uint64_t{64} << 20));
}

TEST_CASE("file-system space of a missing folder is ENOENT", "[machine]") {
  uint64_t free_bytes = 0, total_bytes = 0;
  const std::string missing = (fs::temp_directory_path() / "ts-no-such-folder" / "x").u8string();
  CHECK(FileSystemSpace(missing, &free_bytes, &total_bytes) == ENOENT);
}

TEST_CASE("the lock limit is reported", "[machine]") { CHECK(LockedMemoryLimit() > 0); }

TEST_CASE("this process's user is named", "[user]") {
  const std::string who = DescribeCurrentUser();
  CHECK_FALSE(who.empty());
  CHECK(who.find("unknown") == std::string::npos);
}
