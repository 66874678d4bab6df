#include "process/config.h"

#include <cstdint>

#include "catch_compat.h"
#include "process/startup_checks.h"
#include "security/token.h"

using namespace trainstream::daemon;

TEST_CASE("ParseBytes understands units", "[config]") {
  uint64_t v = 0;
  REQUIRE(ParseBytes("4096", "x", &v).ok());
  CHECK(v == 4096);
  REQUIRE(ParseBytes("64G", "x", &v).ok());
  CHECK(v == 64ull << 30);
  REQUIRE(ParseBytes("512m", "x", &v).ok());
  CHECK(v == 512ull << 20);
  REQUIRE(ParseBytes("1.5T", "x", &v).ok());
  CHECK(v == (3ull << 40) / 2);
  REQUIRE(ParseBytes("8GiB", "x", &v).ok());
  CHECK(v == 8ull << 30);
  auto bad = ParseBytes("12Q", "budget", &v);
  CHECK(bad.code() == trainstream::StatusCode::kInvalidArgument);
  CHECK(bad.message().find("budget") == 0);
  CHECK_FALSE(ParseBytes("", "x", &v).ok());
  CHECK_FALSE(ParseBytes("G", "x", &v).ok());
  CHECK_FALSE(ParseBytes("1e400", "x", &v).ok());
}

TEST_CASE("ParseBudget accepts a percentage of RAM", "[config]") {
  uint64_t v = 0;
  REQUIRE(ParseBudget("50%", 1000, &v).ok());
  CHECK(v == 500);
  REQUIRE(ParseBudget("2G", 1000, &v).ok());
  CHECK(v == 2ull << 30);
  CHECK_FALSE(ParseBudget("0%", 1000, &v).ok());
  CHECK_FALSE(ParseBudget("150%", 1000, &v).ok());
  CHECK_FALSE(ParseBudget("0", 1000, &v).ok());
  CHECK_FALSE(ParseBudget("abc%", 1000, &v).ok());
}

TEST_CASE("Config file: key = value, comments, quotes, errors name file:line", "[config]") {
  DaemonConfig c;
  const char* text =
      "# TrainStream\n"
      "socket = \"/run/x.sock\"\n"
      "shm_dir = /dev/hugepages   # trailing comment\n"
      "\n"
      "budget = 75%\n"
      "log_level = debug\n"
      "threads = 12\n"
      "load_threads = 6\n"
      "idle_exit = 300\n"
      "allow_group = trainstream\n"
      "admin_group = wheel\n"
      "max_region_bytes = 1G\n"
      "max_connections_per_uid = 16\n"
      "lock_memory = false\n";
  auto s = ParseConfigText(text, "t.conf", &c);
  REQUIRE(s.ok());
  CHECK(c.socket_path == "/run/x.sock");
  CHECK(c.shm_dir == "/dev/hugepages");
  CHECK(c.budget == "75%");
  CHECK(c.log_level == "debug");
  CHECK(c.threads == 12);
  CHECK(c.load_threads == 6);
  CHECK(c.idle_exit_s == 300);
  CHECK(c.allow_group == "trainstream");
  CHECK(c.admin_group == "wheel");
  CHECK(c.max_region_bytes == 1ull << 30);
  CHECK(c.max_connections_per_uid == 16);
  CHECK_FALSE(c.lock_memory);
  CHECK(DaemonConfig().max_connections_per_uid == 64);

  DaemonConfig d;
  auto e = ParseConfigText("budget = 1G\nbogus = 1\n", "t.conf", &d);
  CHECK(e.message().find("t.conf:2") == 0);
  CHECK(e.message().find("bogus") != std::string::npos);
  CHECK(ParseConfigText("threads = many\n", "f", &d).message().find("f:1") == 0);
  CHECK_FALSE(ParseConfigText("log_level = loud\n", "f", &d).ok());
  CHECK_FALSE(ParseConfigText("budget = 200%\n", "f", &d).ok());
  CHECK_FALSE(ParseConfigText("no equals sign\n", "f", &d).ok());
  CHECK_FALSE(ParseConfigText("lock_memory = maybe\n", "f", &d).ok());
  CHECK_FALSE(ParseConfigText("max_connections_per_uid = -1\n", "f", &d).ok());
  CHECK_FALSE(ParseConfigText("max_connections_per_uid = 2000000\n", "f", &d).ok());
  CHECK(ParseConfigText("load_threads = 5000\n", "f", &d).message().find("at most 4096") !=
        std::string::npos);
  CHECK(LoadConfigFile("/nonexistent/trainstreamd.conf", &d).code() ==
        trainstream::StatusCode::kNotFound);
}

TEST_CASE("A base load runs the asked threads, capped at load_threads", "[config]") {
  DaemonConfig c;
  CHECK(BaseLoadThreads(c, 0) == AvailableCpus());
  CHECK(AvailableCpus() >= 1);
  c.load_threads = 3;
  CHECK(BaseLoadThreads(c, 0) == 3);
  CHECK(BaseLoadThreads(c, 2) == 2);
  CHECK(BaseLoadThreads(c, 8) == 3);
}

TEST_CASE("Tokens are 128-bit random hex and differ", "[token]") {
  std::string a = RandomHex(16), b = RandomHex(16);
  CHECK(a.size() == 32);
  CHECK(a.find_first_not_of("0123456789abcdef") == std::string::npos);
  CHECK(a != b);
  CHECK(ConstantTimeEquals(a, a));
  CHECK_FALSE(ConstantTimeEquals(a, b));
  CHECK_FALSE(ConstantTimeEquals(a, a.substr(1)));
}

TEST_CASE("Startup checks warn with the fix and refuse what cannot work", "[startup]") {
  StartupFacts f;
  f.shm_dir = "/dev/shm";
  f.budget = 1ull << 60;  // far beyond any /dev/shm, RAM and memlock limit
  f.lock_memory = true;
  f.privileged = false;
  f.memlock_limit = 8 << 20;
  f.ram_bytes = 1ull << 30;
  StartupReport r = CheckStartup(f);
  CHECK(r.error.empty());
  bool mount_fix = false, memlock_fix = false;
  for (const auto& w : r.warnings) {
    mount_fix = mount_fix || w.find("mount -o remount,size=") != std::string::npos;
    memlock_fix = memlock_fix || w.find("LimitMEMLOCK=infinity") != std::string::npos;
  }
  CHECK(mount_fix);
  CHECK(memlock_fix);

  f.budget = 1 << 20;
  f.memlock_limit = UINT64_MAX;
  CHECK(CheckStartup(f).warnings.empty());
  f.shm_dir = "/nonexistent-shm";
  CHECK(CheckStartup(f).error.find("/nonexistent-shm") != std::string::npos);
  f.shm_dir = "/etc/hostname";
  CHECK(CheckStartup(f).error.find("not a directory") != std::string::npos);
}
