// What segments do alike on every system through the shm seam
// (trainstream/platform/shm.h), in a directory of plain files: built and run on
// Linux and, cross-built, under wine64 (docs/windows.md). The POSIX side's own
// rules (/dev/shm, modes, symlinks) are in shm_test.cc.
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <system_error>

#include "catch_compat.h"
#include "trainstream/platform/shm.h"
#include "trainstream/platform/sys_call.h"

using namespace trainstream::platform;
namespace fs = std::filesystem;

namespace {

// A fresh directory under the system's temporary one, removed with its files.
struct TempDir {
  std::string path;
  TempDir() {
    std::random_device seed;
    const fs::path p = fs::temp_directory_path() / ("ts-shmfile-" + std::to_string(seed()));
    fs::create_directory(p);
    path = p.string();
  }
  ~TempDir() {
    std::error_code ignored;
    fs::remove_all(path, ignored);
  }
};

constexpr uint64_t kBytes = uint64_t{1} << 20;

}  // namespace

TEST_CASE("a segment is created once, sized, mapped by two handles and removed", "[shm]") {
  TempDir dir;
  ShmFile file;
  REQUIRE(ShmFile::Create(dir.path, "seg", &file) == 0);
  ShmFile again;
  CHECK(ShmFile::Create(dir.path, "seg", &again) == EEXIST);

  uint64_t size = 1;
  REQUIRE(file.GetSize(&size) == 0);
  CHECK(size == 0);
  REQUIRE(file.Allocate(kBytes) == 0);
  REQUIRE(file.GetSize(&size) == 0);
  CHECK(size == kBytes);
  REQUIRE(file.Allocate(kBytes / 2) == 0);  // never shrinks
  REQUIRE(file.GetSize(&size) == 0);
  CHECK(size == kBytes);

  std::unique_ptr<ShmMapping> writer;
  REQUIRE(ShmMapping::Map(file, ShmAccess::kReadWrite, kBytes, true, &writer) == 0);
  REQUIRE(writer->size() == kBytes);
  auto* w = static_cast<unsigned char*>(writer->data());
  for (uint64_t i = 0; i < kBytes; i += 4096) w[i] = static_cast<unsigned char>(i / 4096 + 1);
  CHECK(w[kBytes - 1] == 0);  // the rest reads as zeros

  ShmFile reader_file;
  REQUIRE(ShmFile::Open(dir.path, "seg", ShmAccess::kReadOnly, &reader_file) == 0);
  std::unique_ptr<ShmMapping> reader;
  REQUIRE(ShmMapping::Map(reader_file, ShmAccess::kReadOnly, kBytes, false, &reader) == 0);
  const auto* r = static_cast<const unsigned char*>(reader->data());
  CHECK(std::memcmp(r, w, kBytes) == 0);

  // Removed while open and mapped: the mappings stay, and both still see
  // each other's stores. (The name goes at once on Linux and on Windows with
  // POSIX deletes, once the last handle closes under Wine: shm_windows.cc.)
  REQUIRE(ShmFile::Remove(dir.path, "seg") == 0);
  w[12345] = 77;
  CHECK(r[12345] == 77);
  writer.reset();
  reader.reset();
  file = ShmFile();
  reader_file = ShmFile();
  ShmFile gone;
  CHECK(ShmFile::Open(dir.path, "seg", ShmAccess::kReadOnly, &gone) == ENOENT);
  CHECK(ShmFile::Remove(dir.path, "seg") == ENOENT);
  CHECK(ShmFile::Create(dir.path, "seg", &gone) == 0);  // the name is free again
}

TEST_CASE("a segment reopened read-write after its handles closed keeps its bytes", "[shm]") {
  TempDir dir;
  {
    ShmFile file;
    REQUIRE(ShmFile::Create(dir.path, "state", &file) == 0);
    REQUIRE(file.Allocate(kBytes) == 0);
    std::unique_ptr<ShmMapping> m;
    REQUIRE(ShmMapping::Map(file, ShmAccess::kReadWrite, kBytes, false, &m) == 0);
    std::memcpy(m->data(), "adoptable", 10);
  }  // as a daemon that died: no handle, no mapping left
  ShmFile file;
  REQUIRE(ShmFile::Open(dir.path, "state", ShmAccess::kReadWrite, &file) == 0);
  uint64_t size = 0;
  REQUIRE(file.GetSize(&size) == 0);
  CHECK(size == kBytes);
  std::unique_ptr<ShmMapping> m;
  REQUIRE(ShmMapping::Map(file, ShmAccess::kReadWrite, kBytes, false, &m) == 0);
  CHECK(std::strcmp(static_cast<const char*>(m->data()), "adoptable") == 0);
  REQUIRE(ShmFile::Remove(dir.path, "state") == 0);
}

TEST_CASE("the seam refuses what it cannot do, with an errno", "[shm]") {
  TempDir dir;
  ShmFile none;
  CHECK(none.Allocate(kBytes) == EBADF);
  uint64_t size = 0;
  CHECK(none.GetSize(&size) == EBADF);
  std::unique_ptr<ShmMapping> m;
  CHECK(ShmMapping::Map(none, ShmAccess::kReadOnly, kBytes, false, &m) == EBADF);
  CHECK(ShmFile::Open(dir.path, "missing", ShmAccess::kReadOnly, &none) == ENOENT);
  CHECK(ShmFile::Create(dir.path + "/no-such-dir", "seg", &none) == ENOENT);

  ShmFile file;
  REQUIRE(ShmFile::Create(dir.path, "seg", &file) == 0);
  REQUIRE(file.Allocate(kBytes) == 0);
  CHECK(ShmMapping::Map(file, ShmAccess::kReadWrite, 0, false, &m) == EINVAL);
  CHECK(m == nullptr);
}

// Beyond Windows' default minimum working set (a few hundred KiB), so the
// Windows side has to raise the quota (Note [Locking memory on Windows]).
TEST_CASE("a mapping is locked in RAM, past the default working-set quota", "[shm]") {
  TempDir dir;
  ShmFile file;
  constexpr uint64_t kLocked = uint64_t{16} << 20;
  REQUIRE(ShmFile::Create(dir.path, "locked", &file) == 0);
  REQUIRE(file.Allocate(kLocked) == 0);
  std::unique_ptr<ShmMapping> mapping;
  REQUIRE(ShmMapping::Map(file, ShmAccess::kReadWrite, kLocked, false, &mapping) == 0);
  const int err = mapping->Lock();
  // Over RLIMIT_MEMLOCK without CAP_IPC_LOCK: what the daemon's startup check
  // warns about (daemon/process/startup_checks.cc); the seam reports it as mlock does.
  if (err == ENOMEM || err == EPERM || err == EAGAIN) {
    TS_SKIP(ErrnoText("this process may not lock 16 MiB", err));
  }
  REQUIRE(err == 0);
  std::memset(mapping->data(), 0x5a, kLocked);
  CHECK(static_cast<unsigned char*>(mapping->data())[kLocked - 1] == 0x5a);
  REQUIRE(ShmFile::Remove(dir.path, "locked") == 0);
}

TEST_CASE("a created segment's facts: regular, one link, this user's, its size", "[shm]") {
  TempDir dir;
  ShmFile file;
  REQUIRE(ShmFile::Create(dir.path, "facts", &file) == 0);
  REQUIRE(file.Allocate(kBytes) == 0);
  ShmFileFacts facts;
  REQUIRE(file.Describe(&facts) == 0);
  CHECK(facts.regular);
  CHECK(facts.links == 1);
  CHECK(facts.owner == CurrentUserId());
  CHECK(facts.bytes == kBytes);
  // Giving it to its own user changes nothing, and so does sharing it
  // read-only with that user; then it still opens for adoption.
  CHECK(file.GiveTo(CurrentUserId()) == 0);
  CHECK(ShmFile::ShareReadOnly(dir.path, "facts", CurrentUserId()) == 0);
  ShmFile again;
  CHECK(ShmFile::Open(dir.path, "facts", ShmAccess::kReadOnly, &again) == 0);
  ShmFileFacts facts_again;
  REQUIRE(again.Describe(&facts_again) == 0);
  CHECK(facts_again.bytes == kBytes);
  CHECK(ShmFile::Remove(dir.path, "facts") == 0);
}
