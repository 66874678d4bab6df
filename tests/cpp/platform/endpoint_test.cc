// The endpoint seam (trainstream/platform/endpoint.h) and the secrets it
// holds (trainstream/platform/random.h) on the system it was built for:
// secrets, the file's round trip and replacement, and every way a file can be
// wrong. The file's owner-only permission is checked on Linux
// (endpoint_linux_test.cc); Wine keeps no DACL to check (docs/windows.md).
#include "trainstream/platform/endpoint.h"

#include <cerrno>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <system_error>

#include "catch_compat.h"
#include "trainstream/platform/random.h"

using namespace trainstream::platform;
namespace fs = std::filesystem;

namespace {

struct TempDir {
  fs::path path;
  TempDir() {
    std::random_device seed;
    path = fs::temp_directory_path() / ("ts-endpoint-" + std::to_string(seed()));
    fs::create_directory(path);
  }
  ~TempDir() {
    std::error_code ignored;
    fs::remove_all(path, ignored);
  }
};

void WriteText(const fs::path& path, const std::string& text) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
}

const std::string kSecret(64, 'a');

}  // namespace

TEST_CASE("a new secret is 32 random bytes in lowercase hex", "[endpoint]") {
  std::string a, b;
  REQUIRE(NewEndpointSecret(&a) == 0);
  REQUIRE(NewEndpointSecret(&b) == 0);
  CHECK(a.size() == 64);
  CHECK(a.find_first_not_of("0123456789abcdef") == std::string::npos);
  CHECK(a != b);
}

TEST_CASE("an endpoint file round-trips and a new one replaces the old", "[endpoint]") {
  TempDir dir;
  const std::string path = (dir.path / "trainstreamd.endpoint").string();
  Endpoint first{"127.0.0.1:50051", ""};
  REQUIRE(NewEndpointSecret(&first.secret) == 0);
  REQUIRE(WriteEndpointFile(path, first) == 0);
  Endpoint read;
  std::string why;
  REQUIRE(ReadEndpointFile(path, &read, &why) == 0);
  CHECK(read.address == first.address);
  CHECK(read.secret == first.secret);

  Endpoint second{"127.0.0.1:65535", ""};
  REQUIRE(NewEndpointSecret(&second.secret) == 0);
  REQUIRE(WriteEndpointFile(path, second) == 0);
  REQUIRE(ReadEndpointFile(path, &read, &why) == 0);
  CHECK(read.address == second.address);
  CHECK(read.secret == second.secret);
  // Nothing is left beside it.
  size_t files = 0;
  for (const auto& entry : fs::directory_iterator(dir.path)) files += entry.is_regular_file();
  CHECK(files == 1);
}

TEST_CASE("what the format cannot hold is not written", "[endpoint]") {
  TempDir dir;
  const std::string path = (dir.path / "e").string();
  CHECK(WriteEndpointFile(path, {"127.0.0.1", kSecret}) == EINVAL);        // no port
  CHECK(WriteEndpointFile(path, {"127.0.0.1:0", kSecret}) == EINVAL);      // port 0
  CHECK(WriteEndpointFile(path, {"127.0.0.1:65536", kSecret}) == EINVAL);  // too large
  CHECK(WriteEndpointFile(path, {"127.0.0.1:5 0", kSecret}) == EINVAL);    // whitespace
  CHECK(WriteEndpointFile(path, {"127.0.0.1:50051", "abc"}) == EINVAL);    // short secret
  CHECK(WriteEndpointFile(path, {"127.0.0.1:50051", std::string(64, 'A')}) == EINVAL);
  CHECK(!fs::exists(path));
}

TEST_CASE("a missing or malformed endpoint file is refused with what is wrong", "[endpoint]") {
  TempDir dir;
  const fs::path path = dir.path / "e";
  Endpoint out;
  std::string why;
  CHECK(ReadEndpointFile(path.string(), &out, &why) == ENOENT);

  const std::string good_secret = "secret " + kSecret + "\n";
  struct Case {
    std::string text, says;
  } cases[] = {
      {"", "first line"},
      {"trainstream-endpoint 2\naddress 127.0.0.1:1\n" + good_secret, "first line"},
      {"trainstream-endpoint 1\nport 1\n" + good_secret, "no 'address' line"},
      {"trainstream-endpoint 1\naddress 127.0.0.1:1\n", "no 'secret' line"},
      {"trainstream-endpoint 1\naddress localhost\n" + good_secret, "not host:port"},
      {"trainstream-endpoint 1\naddress 127.0.0.1:1\nsecret 12\n", "lowercase hex"},
      {"trainstream-endpoint 1\naddress 127.0.0.1:1\n" + good_secret + "more\n", "three lines"},
  };
  for (const auto& c : cases) {
    WriteText(path, c.text);
    why.clear();
    INFO(c.text);
    CHECK(ReadEndpointFile(path.string(), &out, &why) == EINVAL);
    CHECK(why.find(c.says) != std::string::npos);
    CHECK(why.find(path.string()) != std::string::npos);
  }
}

TEST_CASE("secrets compare equal only when equal", "[endpoint]") {
  CHECK(ConstantTimeEquals(kSecret, kSecret));
  CHECK(!ConstantTimeEquals(kSecret, std::string(63, 'a') + "b"));
  CHECK(!ConstantTimeEquals(kSecret, std::string(63, 'a')));
  CHECK(!ConstantTimeEquals("", kSecret));
  CHECK(ConstantTimeEquals("", ""));
}
