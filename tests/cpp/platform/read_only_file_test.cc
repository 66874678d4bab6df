// The read-only file seam (trainstream/platform/read_only_file.h) and the
// lock file of files.h on the system it was built for, set up and checked
// through std::filesystem: a folder opened, the names in it, a file opened
// under it and read at offsets, its facts and its size as it changes.
#include "trainstream/platform/read_only_file.h"

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "catch_compat.h"
#include "temp_folder.h"
#include "trainstream/platform/files.h"

using namespace trainstream::platform;
namespace fs = std::filesystem;
using trainstream::platform::testing::TempFolder;

TEST_CASE("a file under an opened folder reads at offsets", "[read_only_file]") {
  TempFolder folder("ts-read-only-");
  folder.Write("model.safetensors", "0123456789");
  fs::create_directory(folder.path / "sub");
  ReadOnlyFile dir;
  REQUIRE(ReadOnlyFile::Open(nullptr, folder.path.u8string(), &dir) == 0);
  CHECK(dir.facts().directory);
  CHECK_FALSE(dir.facts().regular);

  ReadOnlyFile file;
  REQUIRE(ReadOnlyFile::Open(&dir, "model.safetensors", &file) == 0);
  CHECK(file.is_open());
  CHECK(file.facts().regular);
  CHECK_FALSE(file.facts().directory);
  CHECK(file.facts().size == 10);
  CHECK(file.facts().mtime_ns != 0);
  char buf[4] = {};
  CHECK(file.ReadAt(buf, 4, 3) == 4);
  CHECK(std::string(buf, 4) == "3456");
  CHECK(file.ReadAt(buf, 4, 8) == 2);  // a short read at the end
  CHECK(std::string(buf, 2) == "89");
  CHECK(file.ReadAt(buf, 4, 10) == 0);  // the end
  file.DropFromCache(0, 10);            // a hint: nothing to check but that it returns

  ReadOnlyFile sub;
  REQUIRE(ReadOnlyFile::Open(&dir, "sub", &sub) == 0);
  CHECK(sub.facts().directory);
  ReadOnlyFile missing;
  CHECK(ReadOnlyFile::Open(&dir, "absent.safetensors", &missing) == ENOENT);
  CHECK_FALSE(missing.is_open());
}

TEST_CASE("two opens of one file have one identity; another file has its own", "[read_only_file]") {
  TempFolder folder("ts-read-only-");
  folder.Write("a", "a");
  folder.Write("b", "b");
  ReadOnlyFile a1, a2, b;
  REQUIRE(ReadOnlyFile::Open(nullptr, (folder.path / "a").u8string(), &a1) == 0);
  REQUIRE(ReadOnlyFile::Open(nullptr, (folder.path / "a").u8string(), &a2) == 0);
  REQUIRE(ReadOnlyFile::Open(nullptr, (folder.path / "b").u8string(), &b) == 0);
  CHECK(a1.facts().dev == a2.facts().dev);
  CHECK(a1.facts().ino == a2.facts().ino);
  CHECK(a1.facts().ino != b.facts().ino);
  // Moved, the file stays open and keeps its facts.
  ReadOnlyFile moved = std::move(a1);
  CHECK(moved.is_open());
  CHECK_FALSE(a1.is_open());
  CHECK(moved.facts().ino == a2.facts().ino);
}

TEST_CASE("the size now follows the file; the facts keep the size at the open",
          "[read_only_file]") {
  TempFolder folder("ts-read-only-");
  folder.Write("grows", "12345");
  const fs::path path = folder.path / "grows";
  ReadOnlyFile file;
  REQUIRE(ReadOnlyFile::Open(nullptr, path.u8string(), &file) == 0);
  fs::resize_file(path, 64);
  uint64_t size = 0;
  REQUIRE(file.CurrentSize(&size) == 0);
  CHECK(size == 64);
  CHECK(file.facts().size == 5);
  fs::resize_file(path, 2);
  REQUIRE(file.CurrentSize(&size) == 0);
  CHECK(size == 2);
  char buf[8] = {};
  CHECK(file.ReadAt(buf, 8, 0) == 2);
}

TEST_CASE("a folder lists each name until the caller stops", "[read_only_file]") {
  TempFolder folder("ts-read-only-");
  for (const char* name : {"x.safetensors", "y.safetensors", "z.txt"}) folder.Write(name, "-");
  ReadOnlyFile dir;
  REQUIRE(ReadOnlyFile::Open(nullptr, folder.path.u8string(), &dir) == 0);
  std::vector<std::string> names;
  REQUIRE(dir.ListNames([&](const std::string& name) {
    if (name != "." && name != "..") names.push_back(name);
    return true;
  }) == 0);
  std::sort(names.begin(), names.end());
  CHECK(names == std::vector<std::string>{"x.safetensors", "y.safetensors", "z.txt"});
  size_t seen = 0;
  REQUIRE(dir.ListNames([&](const std::string&) { return ++seen < 2; }) == 0);
  CHECK(seen == 2);
}

TEST_CASE("absolute paths are the system's", "[read_only_file]") {
  CHECK_FALSE(IsAbsolutePath(""));
  CHECK_FALSE(IsAbsolutePath("model.safetensors"));
  CHECK(IsAbsolutePath(fs::temp_directory_path().u8string()));
  const std::string joined =
      fs::temp_directory_path().u8string() + PathSeparator() + "model.safetensors";
  CHECK(fs::path(joined).filename() == "model.safetensors");
}

TEST_CASE("a lock file is held by one holder at a time", "[read_only_file][files]") {
  TempFolder folder("ts-read-only-");
  const std::string dir = (folder.path / "a" / "b").u8string();
  REQUIRE(MakeDirectories(dir) == 0);
  CHECK(fs::is_directory(dir));
  CHECK(MakeDirectories(dir) == 0);  // already there
  const std::string lock = (fs::path(dir) / "d.lock").u8string();
  intptr_t first = -1, second = -1;
  REQUIRE(LockFile(lock, &first) == 0);
  CHECK(LockFile(lock, &second) == EWOULDBLOCK);
  // The holder still reads and rewrites the file (the lock file's text).
  REQUIRE(OverwriteFile(lock, "pid 1\n") == 0);
  std::string text;
  REQUIRE(ReadFilePrefix(lock, 100, &text) == 0);
  CHECK(text == "pid 1\n");
  UnlockFile(first);
  REQUIRE(LockFile(lock, &second) == 0);
  UnlockFile(second);
}
