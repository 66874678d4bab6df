// The files seam (trainstream/platform/files.h) on the system it was built
// for: listings, reading a file's start, rewriting and removing, set up and
// checked through std::filesystem. Links and special files, which only the
// Linux side can make here, are files_linux_test.cc.
#include "trainstream/platform/files.h"

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "catch_compat.h"
#include "temp_folder.h"

using namespace trainstream::platform;
namespace fs = std::filesystem;
using trainstream::platform::testing::TempFolder;

namespace {

const DirectoryEntry* Find(const std::vector<DirectoryEntry>& entries, const std::string& name) {
  auto it = std::find_if(entries.begin(), entries.end(),
                         [&](const DirectoryEntry& e) { return e.name == name; });
  return it == entries.end() ? nullptr : &*it;
}

}  // namespace

TEST_CASE("a listing names each entry once with its kind and size", "[files]") {
  TempFolder folder("ts-files-");
  folder.Write("trainstream-a", "hello");
  folder.Write("empty", "");
  fs::create_directory(folder.path / "sub");
  std::vector<DirectoryEntry> entries;
  REQUIRE(ListDirectory(folder.path.u8string(), &entries) == 0);
  REQUIRE(entries.size() == 3);
  const DirectoryEntry* a = Find(entries, "trainstream-a");
  REQUIRE(a != nullptr);
  CHECK(a->kind == FileKind::kRegular);
  CHECK(a->size == 5);
  REQUIRE(Find(entries, "empty") != nullptr);
  CHECK(Find(entries, "empty")->size == 0);
  REQUIRE(Find(entries, "sub") != nullptr);
  CHECK(Find(entries, "sub")->kind == FileKind::kDirectory);
  CHECK(Find(entries, ".") == nullptr);
  CHECK(Find(entries, "..") == nullptr);
}

TEST_CASE("an empty, a missing and a non-folder listing", "[files]") {
  TempFolder folder("ts-files-");
  std::vector<DirectoryEntry> entries{{"stale", FileKind::kOther, 1}};
  CHECK(ListDirectory(folder.path.u8string(), &entries) == 0);
  CHECK(entries.empty());
  CHECK(ListDirectory(folder / "missing", &entries) == ENOENT);
  CHECK(ListDirectory(folder.Write("file", "x"), &entries) == ENOTDIR);
}

TEST_CASE("reading a file's start", "[files]") {
  TempFolder folder("ts-files-");
  const std::string path = folder.Write("f", std::string("ab\0cd", 5));
  std::string text = "stale";
  REQUIRE(ReadFilePrefix(path, 4096, &text) == 0);
  CHECK(text == std::string("ab\0cd", 5));
  REQUIRE(ReadFilePrefix(path, 3, &text) == 0);
  CHECK(text == std::string("ab\0", 3));
  REQUIRE(ReadFilePrefix(path, 0, &text) == 0);
  CHECK(text.empty());
  CHECK(ReadFilePrefix(folder / "missing", 16, &text) == ENOENT);
  CHECK(text.empty());
  fs::create_directory(folder.path / "sub");
  CHECK(ReadFilePrefix(folder / "sub", 16, &text) == EINVAL);
}

TEST_CASE("overwriting keeps the file and leaves only the new text", "[files]") {
  TempFolder folder("ts-files-");
  const std::string path = folder.Write("lock", "pid=123456\nshm_dir=/dev/shm\n");
  REQUIRE(OverwriteFile(path, "pid=7\n") == 0);
  std::string text;
  REQUIRE(ReadFilePrefix(path, 4096, &text) == 0);
  CHECK(text == "pid=7\n");
  REQUIRE(OverwriteFile(path, "") == 0);
  CHECK(fs::file_size(fs::u8path(path)) == 0);
  CHECK(OverwriteFile(folder / "missing", "x") == ENOENT);
  CHECK_FALSE(fs::exists(fs::u8path(folder / "missing")));
}

TEST_CASE("removing a file, then a missing one", "[files]") {
  TempFolder folder("ts-files-");
  const std::string path = folder.Write("segment", "x");
  CHECK(RemoveFile(path) == 0);
  CHECK_FALSE(fs::exists(fs::u8path(path)));
  CHECK(RemoveFile(path) == ENOENT);
}
