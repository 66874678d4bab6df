// Note [Client pages can vanish]: a truncated file under a guarded mapping
// costs the owner its session, never the daemon; anywhere else SIGBUS still kills.
#include "memory/client_memory_guard.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include "catch_compat.h"

using trainstream::daemon::ClientMemoryGuard;

namespace {

constexpr size_t kBytes = 1 << 20;

// A file in /dev/shm, filled with 0x5a and mapped shared; unlinked at once.
char* MapFile(int* fd_out) {
  std::string path = "/dev/shm/trainstream-guard-test-XXXXXX";
  int fd = mkstemp(path.data());
  REQUIRE(fd >= 0);
  unlink(path.c_str());
  REQUIRE(ftruncate(fd, kBytes) == 0);
  void* p = mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  REQUIRE(p != MAP_FAILED);
  std::memset(p, 0x5a, kBytes);
  *fd_out = fd;
  return static_cast<char*>(p);
}

}  // namespace

TEST_CASE("a guarded mapping survives its file's truncation and reports it", "[guard]") {
  REQUIRE(ClientMemoryGuard::Install().ok());
  int fd = -1;
  char* p = MapFile(&fd);
  const int handle = ClientMemoryGuard::Register(p, kBytes, 4242);
  REQUIRE(handle >= 0);
  CHECK_FALSE(ClientMemoryGuard::Faulted(handle));
  REQUIRE(ftruncate(fd, 0) == 0);  // what a hostile client does to its own segment
  // Reads and writes on every page go on (on private zeros now) instead of SIGBUS.
  uint64_t sum = 0;
  for (size_t i = 0; i < kBytes; i += 4096) {
    sum += static_cast<unsigned char>(p[i]);
    p[i] = 1;
  }
  CHECK(sum == 0);
  CHECK(ClientMemoryGuard::Faulted(handle));
  const auto owners = ClientMemoryGuard::TakeFaults();
  REQUIRE(owners.size() == 1);
  CHECK(owners[0] == 4242);
  CHECK(ClientMemoryGuard::TakeFaults().empty());  // reported once
  ClientMemoryGuard::Unregister(handle);
  munmap(p, kBytes);
  close(fd);
}

// Runs `touch` in a child over a freshly truncated file; true when SIGBUS killed it.
template <typename Fn>
bool ChildDiesOfSigbus(Fn touch) {
  pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    int fd = -1;
    char* p = MapFile(&fd);
    touch(p, fd);
    _exit(0);
  }
  int status = 0;
  REQUIRE(waitpid(child, &status, 0) == child);
  return WIFSIGNALED(status) && WTERMSIG(status) == SIGBUS;
}

TEST_CASE("an unguarded mapping still dies of SIGBUS", "[guard]") {
  REQUIRE(ClientMemoryGuard::Install().ok());
  CHECK(ChildDiesOfSigbus([](char* p, int fd) {
    if (ftruncate(fd, 0) != 0) _exit(3);
    volatile char c = p[0];  // no range covers it: the daemon bug must not be hidden
    (void)c;
  }));
}

TEST_CASE("an unregistered range is not repaired any more", "[guard]") {
  REQUIRE(ClientMemoryGuard::Install().ok());
  CHECK(ChildDiesOfSigbus([](char* p, int fd) {
    ClientMemoryGuard::Unregister(ClientMemoryGuard::Register(p, kBytes, 1));
    if (ftruncate(fd, 0) != 0) _exit(3);
    volatile char c = p[0];
    (void)c;
  }));
}
