#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>

#include "catch_compat.h"
#include "memory/shm_segment.h"

using namespace trainstream::daemon;
namespace fs = std::filesystem;

namespace {
struct TempShmDir {
  std::string path;
  TempShmDir() {
    char tmpl[] = "/dev/shm/ts-segtest-XXXXXX";
    path = mkdtemp(tmpl);
  }
  ~TempShmDir() { fs::remove_all(path); }
  size_t count() const {
    size_t n = 0;
    for (auto& e : fs::directory_iterator(path))
      n += e.path().filename().string().rfind("trainstream-", 0) == 0;
    return n;
  }
};
}  // namespace

TEST_CASE("Segments are created O_EXCL 0600 with a header and unlinked on destruction",
          "[segment]") {
  TempShmDir dir;
  SegmentOwner owner;
  owner.session_id = 42;
  owner.uid = getuid();
  owner.job = "job-x";
  owner.rank = 3;
  std::unique_ptr<ShmSegment> seg;
  REQUIRE(ShmSegment::Create(dir.path, 2, 3 * 4096, owner, false, &seg).ok());
  REQUIRE(seg);
  CHECK(seg->name().rfind("trainstream-", 0) == 0);
  CHECK(seg->name().size() == 12 + 32);
  struct stat st {};
  REQUIRE(stat(seg->path().c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0600);
  CHECK(static_cast<uint64_t>(st.st_size) == 3 * 4096);
  CHECK(st.st_blocks * 512 >= 3 * 4096);  // really allocated, not sparse
  auto* h = seg->header();
  CHECK(h->magic == trainstream::wire::kSegmentMagic);
  CHECK(h->kind == 2);
  CHECK(h->session_id == 42);
  CHECK(h->total_bytes == 3 * 4096);
  CHECK(std::string(h->job) == "job-x");
  CHECK(h->rank == 3);
  seg->base()[4096] = 7;  // writable past the header

  std::unique_ptr<ShmSegment> other;
  REQUIRE(ShmSegment::Create(dir.path, 3, 4096, owner, false, &other).ok());
  CHECK(other->name() != seg->name());
  CHECK(dir.count() == 2);
  const std::string path = seg->path();
  seg.reset();
  CHECK_FALSE(fs::exists(path));
  other->Unlink();
  CHECK(dir.count() == 0);
  other->Unlink();  // idempotent
}

// The production directory, where the platform seam opens segments as Boost
// shared_memory_objects (Note [Segments through Boost.Interprocess]): the same
// rules as in any other directory.
TEST_CASE("Segments in /dev/shm itself keep every rule and are unlinked", "[segment]") {
  SegmentOwner owner;
  owner.session_id = 7;
  owner.uid = getuid();
  std::unique_ptr<ShmSegment> seg;
  REQUIRE(ShmSegment::Create("/dev/shm", 2, 2 * 4096, owner, false, &seg).ok());
  REQUIRE(seg);
  CHECK(seg->path() == "/dev/shm/" + seg->name());
  struct stat st {};
  REQUIRE(lstat(seg->path().c_str(), &st) == 0);
  CHECK(S_ISREG(st.st_mode));
  CHECK((st.st_mode & 07777) == 0600);
  CHECK(static_cast<uint64_t>(st.st_size) == 2 * 4096);
  CHECK(st.st_blocks * 512 >= 2 * 4096);  // really allocated, not sparse
  CHECK(seg->header()->magic == trainstream::wire::kSegmentMagic);
  CHECK(seg->header()->session_id == 7);
  seg->base()[4096] = 7;
  CHECK_FALSE(seg->faulted());
  // ShareReadOnly works by path, as in any directory (owner.uid is ours: 0400).
  CHECK(seg->ShareReadOnly().ok());
  REQUIRE(stat(seg->path().c_str(), &st) == 0);
  CHECK((st.st_mode & 07777) == 0400);
  seg->base()[4097] = 8;  // the daemon's own mapping stays writable
  const std::string path = seg->path();
  seg.reset();
  CHECK_FALSE(fs::exists(path));
}

TEST_CASE("A failing posix_fallocate is a clear error and leaves no file", "[segment]") {
  TempShmDir dir;
  // RLIMIT_FSIZE makes fallocate fail (EFBIG) deterministically, as a full
  // /dev/shm would (ENOSPC), without needing a tiny tmpfs mount.
  signal(SIGXFSZ, SIG_IGN);
  struct rlimit old {};
  getrlimit(RLIMIT_FSIZE, &old);
  struct rlimit small = old;
  small.rlim_cur = 64 * 1024;
  REQUIRE(setrlimit(RLIMIT_FSIZE, &small) == 0);
  std::unique_ptr<ShmSegment> seg;
  auto s = ShmSegment::Create(dir.path, 2, 1 << 20, SegmentOwner{}, false, &seg);
  setrlimit(RLIMIT_FSIZE, &old);
  CHECK_FALSE(s.ok());
  CHECK_FALSE(seg);
  CHECK(s.message().find("posix_fallocate") != std::string::npos);
  CHECK(s.message().find(dir.path) != std::string::npos);
  CHECK(s.message().find("free") != std::string::npos);
  CHECK(dir.count() == 0);
}

TEST_CASE("Creating in a missing directory fails without side effects", "[segment]") {
  std::unique_ptr<ShmSegment> seg;
  auto s = ShmSegment::Create("/nonexistent-dir-ts", 2, 8192, SegmentOwner{}, false, &seg);
  CHECK_FALSE(s.ok());
  CHECK(s.message().find("/nonexistent-dir-ts") != std::string::npos);
}
