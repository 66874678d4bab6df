// The Linux side of the files seam: what a client can plant in a shared folder
// like /dev/shm (a symlink, a FIFO) is listed for what it is and never
// followed, opened for writing, or blocked on.
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "catch_compat.h"
#include "trainstream/platform/files.h"

using namespace trainstream::platform;
namespace fs = std::filesystem;

TEST_CASE("on Linux links and FIFOs are listed as such and never read through", "[files]") {
  std::random_device seed;
  const fs::path dir = fs::temp_directory_path() / ("ts-files-linux-" + std::to_string(seed()));
  fs::create_directory(dir);
  const std::string target = (dir / "target").string();
  std::ofstream(target) << "secret";
  const std::string link = (dir / "trainstream-link").string();
  const std::string fifo = (dir / "trainstream-fifo").string();
  REQUIRE(symlink(target.c_str(), link.c_str()) == 0);
  REQUIRE(mkfifo(fifo.c_str(), 0600) == 0);

  std::vector<DirectoryEntry> entries;
  REQUIRE(ListDirectory(dir.string(), &entries) == 0);
  int links = 0, others = 0;
  for (const auto& e : entries) {
    if (e.name == "trainstream-link") links += e.kind == FileKind::kLink;
    if (e.name == "trainstream-fifo") others += e.kind == FileKind::kOther;
  }
  CHECK(links == 1);
  CHECK(others == 1);

  std::string text;
  CHECK(ReadFilePrefix(link, 64, &text) == ELOOP);
  CHECK(text.empty());
  CHECK(ReadFilePrefix(fifo, 64, &text) == EINVAL);  // returns at once: no writer
  CHECK(OverwriteFile(link, "x") == ELOOP);
  CHECK(RemoveFile(link) == 0);
  CHECK(fs::exists(target));  // the link went, not what it named
  std::ifstream in(target);
  std::string kept;
  in >> kept;
  CHECK(kept == "secret");
  fs::remove_all(dir);
}
