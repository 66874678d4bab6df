#include "memory/shm_segment.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <new>

#include "memory/budget.h"
#include "memory/client_memory_guard.h"
#include "token.h"
#include "trainstream/platform/shm.h"
#include "trainstream/v1/control.pb.h"

namespace trainstream::daemon {

namespace {

std::string g_segment_tag;  // set once at startup (SetSegmentTag)

// The "system.posix_acl_access" value granting `uid` read access to a file
// owned by root (the kernel's xattr ACL format, version 2: entries of tag,
// permission and id): user::r, user:<uid>:r, group::-, mask::r, other::-.
std::string ReadOnlyAclFor(uid_t uid) {
  struct Entry {
    uint16_t tag, perm;
    uint32_t id;
  };
  constexpr uint16_t kUserObj = 0x01, kUser = 0x02, kGroupObj = 0x04, kMask = 0x10, kOther = 0x20;
  constexpr uint32_t kUndefined = 0xffffffffu;
  const uint32_t version = 2;
  const Entry entries[] = {{kUserObj, 4, kUndefined},
                           {kUser, 4, static_cast<uint32_t>(uid)},
                           {kGroupObj, 0, kUndefined},
                           {kMask, 4, kUndefined},
                           {kOther, 0, kUndefined}};
  std::string value(reinterpret_cast<const char*>(&version), sizeof(version));
  value.append(reinterpret_cast<const char*>(entries), sizeof(entries));
  return value;
}

}  // namespace

void SetSegmentTag(const std::string& tag) { g_segment_tag = tag; }

std::string SegmentTagFor(const std::string& socket_path) {
  uint32_t h = 2166136261u;  // FNV-1a: stable across builds and machines
  for (unsigned char c : socket_path) h = (h ^ c) * 16777619u;
  char buf[9];
  std::snprintf(buf, sizeof(buf), "%08x", h);
  return buf;
}

ReclaimResult ReclaimSegments(const std::string& dir, const std::string& tag) {
  ReclaimResult out;
  const std::string prefix = "trainstream-" + tag + "-";
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) {
    out.error = "opendir " + dir + ": " + std::strerror(errno);
    return out;
  }
  while (dirent* e = readdir(d)) {
    const std::string name = e->d_name;
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    const std::string path = dir + "/" + name;
    // POSIX, not the seam: a listing, an lstat and a pread are no mapping (Note
    // [Segments through Boost.Interprocess]).
    // lstat, not the file: the systemd unit's root lacks CAP_DAC_OVERRIDE, so a
    // client's 0600 session segment may not open, but it still unlinks
    // (CAP_FOWNER in the sticky /dev/shm).
    struct stat st {};
    if (lstat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
    wire::SegmentHeader h{};
    bool has_header = false;
    if (int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK); fd >= 0) {
      has_header = pread(fd, &h, sizeof(h), 0) == sizeof(h) && h.magic == wire::kSegmentMagic;
      close(fd);
    }
    if (unlink(path.c_str()) != 0) {
      if (out.error.empty()) out.error = "unlink " + path + ": " + std::strerror(errno);
      continue;
    }
    ++out.files;
    out.bytes += static_cast<uint64_t>(st.st_size);
    if (has_header && h.kind == v1::SEGMENT_KIND_STATE) ++out.state_segments;
  }
  closedir(d);
  return out;
}

bool FilesystemSpace(const std::string& dir, uint64_t* free_bytes, uint64_t* total_bytes) {
  struct statvfs st {};
  if (statvfs(dir.c_str(), &st) != 0) return false;
  *free_bytes = static_cast<uint64_t>(st.f_bavail) * st.f_frsize;
  *total_bytes = static_cast<uint64_t>(st.f_blocks) * st.f_frsize;
  return true;
}

Status ShmSegment::Create(const std::string& dir, uint32_t kind, uint64_t total_bytes,
                          const SegmentOwner& owner, bool lock, std::unique_ptr<ShmSegment>* out,
                          bool prefault) {
  if (total_bytes < wire::kSegmentHeaderBytes) {
    return Status(StatusCode::kInternal, "segment smaller than its header");
  }
  std::unique_ptr<ShmSegment> seg(new ShmSegment());
  // Note [Segments outlive a crashed daemon].
  seg->name_ = "trainstream-" + (g_segment_tag.empty() ? "" : g_segment_tag + "-") + RandomHex(16);
  const std::string path = dir + "/" + seg->name_;
  seg->size_ = total_bytes;
  seg->kind_ = kind;

  // Note [Segments through Boost.Interprocess]: the seam creates it O_EXCL,
  // 0600. `file` closes the handle when it goes out of scope; on a failure that
  // is before `seg` unlinks and unmaps, as it always was.
  platform::ShmFile file;
  if (int err = platform::ShmFile::Create(dir, seg->name_, &file); err != 0) {
    auto code =
        err == EACCES || err == EPERM ? StatusCode::kPermissionDenied : StatusCode::kInternal;
    return Status(code, "cannot create segment " + path + ": " + std::strerror(err));
  }
  // The file is ours now: from here on, destroying `seg` unlinks it.
  seg->dir_ = dir;
  seg->path_ = path;
  seg->share_uid_ = owner.uid;
  int rc = file.Allocate(total_bytes);
  if (rc != 0) {
    uint64_t free_bytes = 0, fs_total = 0;
    FilesystemSpace(dir, &free_bytes, &fs_total);
    std::string msg = "cannot allocate " + std::to_string(total_bytes) + " bytes (" +
                      HumanBytes(total_bytes) + ") in " + dir +
                      ": posix_fallocate: " + std::strerror(rc) + "; " + dir + " has " +
                      std::to_string(free_bytes) + " bytes (" + HumanBytes(free_bytes) +
                      ") free of " + HumanBytes(fs_total);
    if (rc == ENOSPC) {
      msg += "; enlarge it (e.g. `mount -o remount,size=<bytes> " + dir +
             "`) or lower the daemon's --budget";
      return Status(StatusCode::kResourceExhausted, msg);
    }
    return Status(StatusCode::kInternal, msg);
  }
  if (int err = platform::ShmMapping::Map(file, platform::ShmAccess::kReadWrite, total_bytes,
                                          /*populate=*/prefault, &seg->mapping_);
      err != 0) {
    return Status(StatusCode::kInternal, "mmap " + seg->path_ + ": " + std::strerror(err));
  }
  void* base = seg->mapping_->data();
  seg->base_ = base;
  // Before the first access, and before any client can open the file.
  seg->guard_ = ClientMemoryGuard::Register(base, total_bytes, owner.session_id);
  if (seg->guard_ < 0) {
    return Status(StatusCode::kResourceExhausted,
                  "the daemon holds " + std::to_string(ClientMemoryGuard::kMaxRanges) +
                      " segments, its limit; free regions or end sessions");
  }
  if (lock) seg->locked_ = mlock(base, total_bytes) == 0;

  auto* h = new (base) wire::SegmentHeader();
  std::memset(static_cast<void*>(h), 0, sizeof(*h));
  h->magic = wire::kSegmentMagic;
  h->version = wire::kSegmentVersion;
  h->kind = kind;
  h->total_bytes = total_bytes;
  h->session_id = owner.session_id;
  h->owner_uid = owner.uid;
  h->created_unix_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                           std::chrono::system_clock::now().time_since_epoch())
                           .count();
  std::strncpy(h->job, owner.job.c_str(), sizeof(h->job) - 1);
  h->rank = owner.rank;
  h->local_rank = owner.local_rank;
  // Note [Who may open a segment]: only session segments become the client's.
  // fchown is POSIX on the seam's handle (Boost knows no owners).
  if (kind == v1::SEGMENT_KIND_SESSION && geteuid() == 0 && owner.uid != 0 &&
      fchown(file.native_handle(), owner.uid, static_cast<gid_t>(-1)) != 0) {
    return Status(StatusCode::kInternal, "fchown " + seg->path_ + " to uid " +
                                             std::to_string(owner.uid) + ": " +
                                             std::strerror(errno));
  }
  *out = std::move(seg);
  return Status::Ok();
}

Status ShmSegment::ShareReadOnly() {
  // Note [Why base segments are read-only] (wire/base_manifest.h). Ownership
  // and ACLs are POSIX, by path (Note [Segments through Boost.Interprocess]).
  if (geteuid() == 0 && share_uid_ != 0) {
    const std::string acl = ReadOnlyAclFor(share_uid_);
    if (chmod(path_.c_str(), 0440) == 0 &&
        setxattr(path_.c_str(), "system.posix_acl_access", acl.data(), acl.size(), 0) == 0) {
      return Status::Ok();
    }
    // No ACLs here: the old way, the owner's own file at 0400.
    if (chown(path_.c_str(), share_uid_, static_cast<gid_t>(-1)) != 0)
      return Status(StatusCode::kInternal, "chown " + path_ + ": " + std::strerror(errno));
  }
  if (chmod(path_.c_str(), 0400) != 0)
    return Status(StatusCode::kInternal, "chmod 0400 " + path_ + ": " + std::strerror(errno));
  return Status::Ok();
}

bool ShmSegment::faulted() const { return ClientMemoryGuard::Faulted(guard_); }

void ShmSegment::Unlink() {
  if (unlinked_ || path_.empty()) return;
  platform::ShmFile::Remove(dir_, name_);
  unlinked_ = true;
}

ShmSegment::~ShmSegment() {
  // A segment whose creation failed before mmap still has a file to remove.
  Unlink();
  if (mapping_ != nullptr) {
    // Note [Client pages can vanish]: out of the guard before the unmap.
    ClientMemoryGuard::Unregister(guard_);
    if (locked_) munlock(base_, size_);
    mapping_.reset();
  }
}

}  // namespace trainstream::daemon
