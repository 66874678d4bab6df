// The endpoint file is the user's alone on Linux: mode 0600 whatever the umask
// (the Windows side's DACL cannot be checked under Wine: docs/windows.md).
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <random>
#include <string>

#include "catch_compat.h"
#include "trainstream/platform/endpoint.h"

using namespace trainstream::platform;

TEST_CASE("an endpoint file has mode 0600 even under umask 0", "[endpoint]") {
  std::random_device seed;
  const std::string path =
      (std::filesystem::temp_directory_path() / ("ts-endpoint-mode-" + std::to_string(seed())))
          .string();
  const mode_t old_mask = umask(0);
  Endpoint e{"127.0.0.1:50051", std::string(64, 'f')};
  const int err = WriteEndpointFile(path, e);
  umask(old_mask);
  REQUIRE(err == 0);
  struct stat st {};
  REQUIRE(stat(path.c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0600);
  CHECK(st.st_uid == geteuid());
  unlink(path.c_str());
}
