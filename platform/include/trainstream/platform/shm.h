// The platform seam for shared-memory segments: how a segment file is created,
// opened, removed and mapped. The daemon (daemon/memory/shm_segment.cc) and the
// client (client/src/mapped_region.cc) both go through it and nothing else.
// Two sides, picked by platform/CMakeLists.txt: shm_posix.cc (below) and
// shm_windows.cc (Note [Segments on Windows are files with an owner-only
// DACL]; docs/windows.md).
//
// Note [Segments through Boost.Interprocess]. Boost.Interprocess does what it
// has a portable call for; the steps it has none for stay POSIX, made on the
// handle Boost opened (native_handle(), Boost's get_mapping_handle()):
//   Boost's                                 POSIX on the handle, or by path
//   create, O_EXCL, mode 0600               posix_fallocate (Boost's truncate is
//     (shared_memory_object, create_only,     ftruncate: sparse, a full /dev/shm
//     permissions 0600, then fchmod)          would SIGBUS later, not fail here)
//   open by name (open_only)                fchown of session segments
//   map, unmap (mapped_region; MAP_POPULATE   the base ACL, chmod (ShareReadOnly:
//     through its map options)                Boost knows no owners or ACLs)
//   remove (shared_memory_object::remove)   mlock (ShmMapping::Lock), the guard's
//                                             MAP_FIXED remap
//                                             (in a signal handler: system
//                                             calls only)
//                                           reclaim: readdir, lstat, pread (no
//                                             mapping of a file a client may
//                                             have truncated)
// The daemon registers each mapping with its ClientMemoryGuard right after Map
// and unregisters it before the mapping is destroyed (Note [Client pages can
// vanish]); mapped_region's munmap covers the same range, so it also removes
// the zero pages the guard may have put there.
// Which Boost class opens the file depends on the directory:
//   /dev/shm   shared_memory_object, the portable named shared memory (glibc's
//              shm_open is open(2) in /dev/shm with O_NOFOLLOW | O_CLOEXEC, so the
//              file and its rules are the same as before). This is the default
//              and production directory. (Not windows_shared_memory on
//              Windows: it dies with its last handle, and segments must outlive
//              the daemon; shm_windows.cc.)
//   any other  (a test's subdirectory, a hugetlbfs mount; --shm-dir) shm_open
//              takes no directory, and Boost's file_mapping (1.74) cannot create a file
//              and opens without O_NOFOLLOW or O_CLOEXEC. So the file is opened
//              with open(2) (O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600) and
//              its descriptor handed to mapped_region, which maps any object with
//              a get_mapping_handle(); mapping and unmapping stay Boost's.
// Boost reports failures by throwing interprocess_exception; nothing is thrown
// out of this seam: every call returns 0 or an errno value, and each caller words
// its own message in its own status type.
//
// The trust-boundary rule (a segment no client can shrink, e.g. a sealed memfd
// passed over the socket) wins where it applies: today no segment is a memfd
// (Note [Client pages can vanish] chose the daemon's SIGBUS guard instead). A
// memfd would be sealed with fcntl on its descriptor and mapped through the same
// descriptor path above, so it too would be mapped by Boost.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "trainstream/platform/user.h"

namespace trainstream::platform {

enum class ShmAccess { kReadOnly, kReadWrite };

// True when segments in `dir` are Boost shared_memory_objects (shm_open's
// directory, "/dev/shm"); false when they are files opened by path.
bool IsSharedMemoryDir(const std::string& dir);

// What the daemon checks of a segment file before it adopts one (Note
// [Segments outlive a crashed daemon]).
struct ShmFileFacts {
  bool regular = false;  // a regular file (not a FIFO, a device, a folder)
  uint64_t links = 0;    // hard links to it (1 for a segment)
  UserId owner = 0;      // its owner (platform/user.h's ids)
  uint64_t bytes = 0;
};

// An open segment file. Owns its handle and closes it on destruction; a mapping
// made from it stays valid after that. Movable, not copyable.
class ShmFile {
 public:
  ShmFile();
  ~ShmFile();
  ShmFile(ShmFile&&) noexcept;
  ShmFile& operator=(ShmFile&&) noexcept;
  ShmFile(const ShmFile&) = delete;
  ShmFile& operator=(const ShmFile&) = delete;

  // Creates `dir`/`name` read-write with mode 0600 whatever the umask; fails
  // with EEXIST when the name exists (never opens someone else's file), and
  // never follows a symlink. `name` holds no '/'. Returns 0 or an errno value.
  static int Create(const std::string& dir, const std::string& name, ShmFile* out);

  // Opens the existing `dir`/`name` (never through a symlink). 0 or errno.
  static int Open(const std::string& dir, const std::string& name, ShmAccess access, ShmFile* out);

  // Removes `dir`/`name`; mappings of it stay valid. 0 or errno.
  static int Remove(const std::string& dir, const std::string& name);

  // Reserves [0, bytes) in the file system (posix_fallocate): the file is
  // `bytes` long and its pages exist, so a full directory fails here (ENOSPC)
  // rather than with SIGBUS at first touch. Returns 0 or an errno value.
  int Allocate(uint64_t bytes);

  // The file's size in bytes. Returns 0 or an errno value.
  int GetSize(uint64_t* bytes) const;

  // Opens `dir`/`name` read-write for adoption by the daemon. As Open; on
  // Linux, when a root daemon without CAP_DAC_OVERRIDE (the systemd unit) may
  // not open a client's 0600 segment, it first names root in the file's ACL
  // (which CAP_FOWNER allows). 0 or errno.
  static int OpenForAdoption(const std::string& dir, const std::string& name, ShmFile* out);

  // Gives the file to `user` (a session segment of a root daemon's client:
  // Note [Who may open a segment]). Linux: fchown. Windows: 0 when `user` is
  // this process's own (whose DACL the file has from Create); ENOTSUP for
  // another user, which needs a DACL naming that user's SID (docs/windows.md).
  int GiveTo(UserId user);

  // The file's facts, from its handle (fstat; GetFileInformationByHandle and
  // the owner's SID). 0 or errno.
  int Describe(ShmFileFacts* out) const;

  // Makes `dir`/`name` read-only for everyone who may open it (Note [Why base
  // segments are read-only], wire/base_manifest.h), and readable by `reader`
  // when this process is privileged and `reader` is another user. Linux: mode
  // 0440 with an ACL naming `reader` (or, with no ACLs, `reader`'s own file at
  // 0400). Windows: nothing to change: the DACL names this process's user
  // alone, and clients map bases read-only (ENOTSUP for another `reader`).
  // 0 or errno.
  static int ShareReadOnly(const std::string& dir, const std::string& name, UserId reader);

  // The file descriptor, for the POSIX steps Boost has no call for.
  // -1 when nothing is open, and always on Windows (no descriptor there; the
  // owner is set by the DACL at creation). Owned by this object.
  int native_handle() const;

 private:
  friend class ShmMapping;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// A MAP_SHARED mapping of [0, bytes) of a segment file (Boost's mapped_region).
// Unmaps on destruction. Not copyable.
class ShmMapping {
 public:
  ~ShmMapping();
  ShmMapping(const ShmMapping&) = delete;
  ShmMapping& operator=(const ShmMapping&) = delete;

  // Maps `file` (open with at least `access`); read-only maps PROT_READ. With
  // `populate`, the pages are faulted in now (MAP_POPULATE). 0 or errno.
  static int Map(const ShmFile& file, ShmAccess access, uint64_t bytes, bool populate,
                 std::unique_ptr<ShmMapping>* out);

  // Locks the whole mapping in RAM, so it is never paged out (the daemon's
  // lock_memory). POSIX: mlock. Windows: VirtualLock, which can lock no more
  // than the process's minimum working set, so when it fails for the quota
  // (ERROR_WORKING_SET_QUOTA) the working set's minimum and maximum are raised
  // by the mapping's size and it is tried once more (Note [Locking memory on
  // Windows], shm_windows.cc). The pages stay locked until the mapping is
  // destroyed. Returns 0 or an errno value (ENOMEM, EPERM, EAGAIN: over the
  // memlock limit or the quota).
  int Lock();

  void* data() const;
  uint64_t size() const;

 private:
  ShmMapping();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace trainstream::platform
