// The rules segments keep through the platform seam (Note [Segments through
// Boost.Interprocess]): each case runs in /dev/shm itself (Boost's
// shared_memory_object) and in a directory below it (a descriptor by path).
#include "trainstream/platform/shm.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>

#include "catch_compat.h"

using namespace trainstream::platform;
namespace fs = std::filesystem;

namespace {

struct TempShmDir {
  std::string path;
  TempShmDir() {
    char tmpl[] = "/dev/shm/ts-platformtest-XXXXXX";
    path = mkdtemp(tmpl);
  }
  ~TempShmDir() { fs::remove_all(path); }
};

// A fresh name per call, removed from `dir` when the case ends.
struct TestName {
  std::string dir, name;
  explicit TestName(std::string d) : dir(std::move(d)) {
    static std::atomic<int> counter{0};
    name = "trainstream-platformtest-" + std::to_string(getpid()) + "-" + std::to_string(counter++);
  }
  ~TestName() { unlink(path().c_str()); }
  std::string path() const { return dir + "/" + name; }
};

// Both kinds of directory: /dev/shm and one below it.
std::string PickDir(const TempShmDir& sub) {
  std::string dir;
  SECTION("in /dev/shm (shared_memory_object)") { dir = "/dev/shm"; }
  SECTION("in another directory (a descriptor by path)") { dir = sub.path; }
  return dir;
}

}  // namespace

TEST_CASE("Only /dev/shm itself is shm_open's directory", "[platform]") {
  CHECK(IsSharedMemoryDir("/dev/shm"));
  CHECK_FALSE(IsSharedMemoryDir("/dev/shm/sub"));
  CHECK_FALSE(IsSharedMemoryDir("/tmp"));
}

TEST_CASE("Create makes a 0600 file whatever the umask, at dir/name", "[platform]") {
  TempShmDir sub;
  const std::string dir = PickDir(sub);
  TestName n(dir);
  const mode_t old_umask = umask(0277);  // would leave 0400 without the fchmod
  ShmFile file;
  const int err = ShmFile::Create(dir, n.name, &file);
  umask(old_umask);
  REQUIRE(err == 0);
  CHECK(file.native_handle() >= 0);
  struct stat st {};
  REQUIRE(lstat(n.path().c_str(), &st) == 0);
  CHECK(S_ISREG(st.st_mode));
  CHECK((st.st_mode & 07777) == 0600);
  CHECK(st.st_uid == geteuid());
  // The descriptor does not leak into exec'd children.
  CHECK((fcntl(file.native_handle(), F_GETFD) & FD_CLOEXEC) != 0);
}

TEST_CASE("Create is exclusive: an existing name or a symlink is EEXIST and untouched",
          "[platform]") {
  TempShmDir sub;
  const std::string dir = PickDir(sub);
  TestName n(dir);
  ShmFile first;
  REQUIRE(ShmFile::Create(dir, n.name, &first) == 0);
  REQUIRE(first.Allocate(4096) == 0);
  ShmFile second;
  CHECK(ShmFile::Create(dir, n.name, &second) == EEXIST);
  CHECK(second.native_handle() == -1);
  uint64_t size = 0;
  REQUIRE(first.GetSize(&size) == 0);
  CHECK(size == 4096);

  // A planted symlink is never followed into its target.
  TestName link(dir);
  const std::string target = sub.path + "/target";
  {
    std::FILE* f = std::fopen(target.c_str(), "w");
    std::fclose(f);
  }
  REQUIRE(symlink(target.c_str(), link.path().c_str()) == 0);
  ShmFile through_link;
  CHECK(ShmFile::Create(dir, link.name, &through_link) == EEXIST);
  CHECK(ShmFile::Open(dir, link.name, ShmAccess::kReadWrite, &through_link) == ELOOP);
  CHECK(fs::file_size(target) == 0);
}

TEST_CASE("Allocate reserves the pages, not a sparse file", "[platform]") {
  TempShmDir sub;
  const std::string dir = PickDir(sub);
  TestName n(dir);
  ShmFile file;
  REQUIRE(ShmFile::Create(dir, n.name, &file) == 0);
  REQUIRE(file.Allocate(3 * 4096) == 0);
  struct stat st {};
  REQUIRE(stat(n.path().c_str(), &st) == 0);
  CHECK(static_cast<uint64_t>(st.st_size) == 3 * 4096);
  CHECK(st.st_blocks * 512 >= 3 * 4096);
  uint64_t size = 0;
  REQUIRE(file.GetSize(&size) == 0);
  CHECK(size == 3 * 4096);
}

TEST_CASE("A mapping is shared, outlives its handle and the file's removal", "[platform]") {
  TempShmDir sub;
  const std::string dir = PickDir(sub);
  TestName n(dir);
  std::unique_ptr<ShmMapping> writer;
  {
    ShmFile file;
    REQUIRE(ShmFile::Create(dir, n.name, &file) == 0);
    REQUIRE(file.Allocate(2 * 4096) == 0);
    REQUIRE(ShmMapping::Map(file, ShmAccess::kReadWrite, 2 * 4096, /*populate=*/true, &writer) ==
            0);
  }  // the handle closes here
  REQUIRE(writer);
  CHECK(writer->size() == 2 * 4096);
  static_cast<char*>(writer->data())[4096 + 5] = 42;

  ShmFile reader_file;
  REQUIRE(ShmFile::Open(dir, n.name, ShmAccess::kReadOnly, &reader_file) == 0);
  std::unique_ptr<ShmMapping> reader;
  // Read-write needs a read-write handle.
  CHECK(ShmMapping::Map(reader_file, ShmAccess::kReadWrite, 2 * 4096, false, &reader) == EACCES);
  CHECK_FALSE(reader);
  REQUIRE(ShmMapping::Map(reader_file, ShmAccess::kReadOnly, 2 * 4096, false, &reader) == 0);
  CHECK(static_cast<const char*>(reader->data())[4096 + 5] == 42);

  REQUIRE(ShmFile::Remove(dir, n.name) == 0);
  CHECK_FALSE(fs::exists(n.path()));
  CHECK(ShmFile::Remove(dir, n.name) == ENOENT);
  static_cast<char*>(writer->data())[7] = 9;  // still mapped, still shared
  CHECK(static_cast<const char*>(reader->data())[7] == 9);
}

TEST_CASE("Opening a missing segment is ENOENT; an empty mapping is refused", "[platform]") {
  TempShmDir sub;
  const std::string dir = PickDir(sub);
  TestName n(dir);
  ShmFile file;
  CHECK(ShmFile::Open(dir, n.name, ShmAccess::kReadOnly, &file) == ENOENT);
  CHECK(file.native_handle() == -1);
  uint64_t size = 0;
  CHECK(file.GetSize(&size) == EBADF);
  CHECK(file.Allocate(4096) == EBADF);
  std::unique_ptr<ShmMapping> mapping;
  CHECK(ShmMapping::Map(file, ShmAccess::kReadOnly, 4096, false, &mapping) == EBADF);

  REQUIRE(ShmFile::Create(dir, n.name, &file) == 0);
  CHECK(ShmMapping::Map(file, ShmAccess::kReadWrite, 0, false, &mapping) == EINVAL);
  CHECK_FALSE(mapping);
}

TEST_CASE("A create in a missing directory fails with ENOENT", "[platform]") {
  ShmFile file;
  CHECK(ShmFile::Create("/nonexistent-dir-ts", "trainstream-x", &file) == ENOENT);
  CHECK(file.native_handle() == -1);
}
