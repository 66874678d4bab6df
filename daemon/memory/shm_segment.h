// ShmSegment: one file the daemon creates in the shm directory (docs/design.md,
// "Memory ownership and segment kinds"): an unguessable name "trainstream-<32 hex>", O_EXCL, mode
// 0600, owned by the attaching user when the daemon runs as root, sized with
// posix_fallocate (so a full /dev/shm fails here, not with SIGBUS later), a
// SegmentHeader at offset 0 and data after kSegmentHeaderBytes. The daemon maps
// it MAP_SHARED (prefaulted, unless asked not to) for its whole life, registered with
// ClientMemoryGuard from before its first access to after its last (Note [Client
// pages can vanish]). The file and the mapping are made through the platform
// seam, Boost.Interprocess where it has the call and POSIX on its handle where it
// has not (Note [Segments through Boost.Interprocess], trainstream/platform/shm.h).
//
// Note [Who may open a segment]. With a daemon running as root and a client of
// another uid, only the kinds a client must map are opened to it:
//   session  chowned to the client: it maps it read-write;
//   state    stays root's, 0600: masters and moments reach a client only through
//            kExportState copies, so no client can write or truncate them;
//   base     stays root's; ShareReadOnly() grants the owning uid read access
//            through a POSIX ACL (user:<uid>:r--), so the client can map it but
//            not chmod, write or truncate it. Where the file system has no ACLs
//            the base is chowned to the client at 0400, as before (it can then
//            chmod its own base back; the daemon survives that, see the guard).
// A daemon that is not root (embedded mode) runs as its only user, so every
// file is that user's; the guard still keeps the daemon alive.
//
// Ownership: the ShmSegment owns the file and the mapping; destroying it unmaps
// and unlinks. It does not touch the budget: callers reserve before Create and
// release after destruction.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <set>
#include <string>

#include "trainstream/platform/user.h"
#include "trainstream/status.h"
#include "trainstream/wire/segment_header.h"

namespace trainstream::platform {
class ShmMapping;  // trainstream/platform/shm.h
}  // namespace trainstream::platform

namespace trainstream::daemon {

// The guard owner of an adopted segment that no session has claimed yet.
inline constexpr uint64_t kAdoptedOwner = ~uint64_t{0};

struct SegmentOwner {
  uint64_t session_id = 0;   // 0: the daemon (bases)
  platform::UserId uid = 0;  // file owner when the daemon runs as root
  std::string job;
  int32_t rank = -1;
  int32_t local_rank = -1;
};

class ShmSegment {
 public:
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;
  ~ShmSegment();

  // Creates a segment of `total_bytes` (>= kSegmentHeaderBytes) in `dir`.
  // `kind` is a trainstream.v1.SegmentKind value. With `lock`, tries mlock();
  // a failure is not an error (locked() says whether it worked). `prefault`
  // maps it MAP_POPULATE; a caller that writes every page soon after (a base
  // load, on several threads) passes false and takes the faults where it writes.
  // Either way its pages exist (posix_fallocate).
  // Errors: RESOURCE_EXHAUSTED when the directory is full (names it, its free
  // space and the fix), INTERNAL/PERMISSION_DENIED for other failures.
  static Status Create(const std::string& dir, uint32_t kind, uint64_t total_bytes,
                       const SegmentOwner& owner, bool lock, std::unique_ptr<ShmSegment>* out,
                       bool prefault = true);

  // Takes over `dir`/`name`, a segment a daemon that died created (Note
  // [Optimizer state outlives the daemon]): opens it (never through a
  // symlink; a root daemon without CAP_DAC_OVERRIDE adds itself to the file's
  // ACL first), checks it is a regular file of one link owned by `owner_uid`,
  // a whole number of pages and, unless 0, `expected_bytes` long, then maps it
  // (prefaulted) guarded for owner kAdoptedOwner until SetOwner, and locks it
  // with `lock`. From then on it is like a created one: destroying it unmaps
  // and unlinks. FAILED_PRECONDITION says what is off (the file is left as it
  // is: the caller decides).
  static Status Adopt(const std::string& dir, const std::string& name, uint32_t kind,
                      platform::UserId owner_uid, uint64_t expected_bytes, bool lock,
                      std::unique_ptr<ShmSegment>* out);

  // An adopted segment's new session: its guard's owner and header's session id.
  void SetOwner(uint64_t session_id);

  // Removes the file now (the mapping stays until destruction). Idempotent.
  void Unlink();

  // Bases, once filled: makes the file read-only for good and readable by the
  // owner's uid (Note [Who may open a segment]). INTERNAL says what failed.
  Status ShareReadOnly();

  // True once a client truncated the file under the daemon's mapping (the
  // mapping holds zeros since; ClientMemoryGuard).
  bool faulted() const;

  const std::string& name() const { return name_; }
  const std::string& path() const { return path_; }
  uint64_t size() const { return size_; }
  uint32_t kind() const { return kind_; }
  bool locked() const { return locked_; }
  char* base() const { return static_cast<char*>(base_); }
  wire::SegmentHeader* header() const { return static_cast<wire::SegmentHeader*>(base_); }

 private:
  ShmSegment() = default;
  std::string name_;
  std::string dir_;
  std::string path_;  // dir_ + "/" + name_
  uint64_t size_ = 0;
  uint32_t kind_ = 0;
  std::unique_ptr<platform::ShmMapping> mapping_;
  void* base_ = nullptr;  // mapping_->data()
  bool locked_ = false;
  bool unlinked_ = false;
  int guard_ = -1;  // ClientMemoryGuard handle of the mapping
  platform::UserId share_uid_ = 0;
};

// Note [Segments outlive a crashed daemon]. A daemon killed by SIGKILL or the
// OOM killer cannot unlink its files, and /dev/shm keeps them until reboot. So
// every segment's name carries its daemon's tag, a hash of the socket path
// ("trainstream-<tag>-<random>"): a daemon that took the socket's lock file (no
// other daemon serves that socket) removes every file with its tag before it
// serves, whoever held them, except the optimizer state it adopts (and the
// staging segments that state's updates read): Note [Optimizer state outlives
// the daemon] (trainstream/wire/state_record.h). The lock file records the pid
// and shm dir of the daemon holding it, so the one that follows knows where to
// look.

// Sets the tag of every segment this process creates from now on (once, at
// startup, before any segment exists). "" (the default) gives untagged names.
void SetSegmentTag(const std::string& tag);
// The tag for a daemon serving `socket_path`: 8 hex digits.
std::string SegmentTagFor(const std::string& socket_path);

struct ReclaimResult {
  uint64_t files = 0;
  uint64_t bytes = 0;
  uint64_t state_segments = 0;  // optimizer state among them (not adopted: lost)
  std::string error;            // first failure, if any (the rest still ran)
};
// Removes every regular file in `dir` named "trainstream-<tag>-*" but those in
// `keep` (adopted). Reads each one's header with pread (never a mapping: a
// client may have truncated it).
ReclaimResult ReclaimSegments(const std::string& dir, const std::string& tag,
                              const std::set<std::string>& keep = {});

// Free and total bytes of the filesystem holding `dir` (statvfs); false on error.
bool FilesystemSpace(const std::string& dir, uint64_t* free_bytes, uint64_t* total_bytes);

}  // namespace trainstream::daemon
