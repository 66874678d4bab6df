#include "memory/shm_segment.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
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
#include "trainstream/platform/machine.h"
#include "trainstream/platform/shm.h"
#include "trainstream/v1/control.pb.h"

namespace trainstream::daemon {

namespace {

std::string g_segment_tag;  // set once at startup (SetSegmentTag)

// A "system.posix_acl_access" value (the kernel's xattr ACL format, version 2:
// entries of tag, permission and id): user::`perm`, user:<uid>:`perm`,
// group::-, mask::`perm`, other::-.
std::string AclFor(uid_t uid, uint16_t perm) {
  struct Entry {
    uint16_t tag, perm;
    uint32_t id;
  };
  constexpr uint16_t kUserObj = 0x01, kUser = 0x02, kGroupObj = 0x04, kMask = 0x10, kOther = 0x20;
  constexpr uint32_t kUndefined = 0xffffffffu;
  const uint32_t version = 2;
  const Entry entries[] = {{kUserObj, perm, kUndefined},
                           {kUser, perm, static_cast<uint32_t>(uid)},
                           {kGroupObj, 0, kUndefined},
                           {kMask, perm, kUndefined},
                           {kOther, 0, kUndefined}};
  std::string value(reinterpret_cast<const char*>(&version), sizeof(version));
  value.append(reinterpret_cast<const char*>(entries), sizeof(entries));
  return value;
}

// Read access for `uid` to a file owned by root (bases: Note [Who may open a segment]).
std::string ReadOnlyAclFor(uid_t uid) { return AclFor(uid, 4); }

}  // namespace

void SetSegmentTag(const std::string& tag) { g_segment_tag = tag; }

std::string SegmentTagFor(const std::string& socket_path) {
  uint32_t h = 2166136261u;  // FNV-1a: stable across builds and machines
  for (unsigned char c : socket_path) h = (h ^ c) * 16777619u;
  char buf[9];
  std::snprintf(buf, sizeof(buf), "%08x", h);
  return buf;
}

ReclaimResult ReclaimSegments(const std::string& dir, const std::string& tag,
                              const std::set<std::string>& keep) {
  ReclaimResult out;
  const std::string prefix = "trainstream-" + tag + "-";
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) {
    out.error = "opendir " + dir + ": " + std::strerror(errno);
    return out;
  }
  while (dirent* e = readdir(d)) {
    const std::string name = e->d_name;
    if (name.compare(0, prefix.size(), prefix) != 0 || keep.count(name) != 0) continue;
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
  return platform::FileSystemSpace(dir, free_bytes, total_bytes) == 0;
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
  if (lock) seg->locked_ = seg->mapping_->Lock() == 0;

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

Status ShmSegment::Adopt(const std::string& dir, const std::string& name, uint32_t kind,
                         uid_t owner_uid, uint64_t expected_bytes, bool lock,
                         std::unique_ptr<ShmSegment>* out) {
  const std::string path = dir + "/" + name;
  auto refuse = [&](const std::string& why) {
    return Status(StatusCode::kFailedPrecondition, "cannot adopt " + path + ": " + why);
  };
  platform::ShmFile file;
  int err = platform::ShmFile::Open(dir, name, platform::ShmAccess::kReadWrite, &file);
  if (err == EACCES && geteuid() == 0) {
    // A client's 0600 session segment and a root daemon without
    // CAP_DAC_OVERRIDE (the systemd unit): CAP_FOWNER may still name root in
    // the file's ACL, and then it opens.
    const std::string acl = AclFor(0, 6);
    if (setxattr(path.c_str(), "system.posix_acl_access", acl.data(), acl.size(), 0) == 0)
      err = platform::ShmFile::Open(dir, name, platform::ShmAccess::kReadWrite, &file);
  }
  if (err != 0) return refuse(std::strerror(err));
  struct stat st {};
  if (fstat(file.native_handle(), &st) != 0) return refuse(std::strerror(errno));
  if (!S_ISREG(st.st_mode)) return refuse("not a regular file");
  if (st.st_nlink != 1) return refuse("it has " + std::to_string(st.st_nlink) + " links");
  if (st.st_uid != owner_uid)
    return refuse("owned by uid " + std::to_string(st.st_uid) + ", expected uid " +
                  std::to_string(owner_uid));
  const uint64_t bytes = static_cast<uint64_t>(st.st_size);
  if (bytes < wire::kSegmentHeaderBytes || bytes % 4096 != 0)
    return refuse("size " + std::to_string(bytes) + " is not a segment's");
  if (expected_bytes != 0 && bytes != expected_bytes)
    return refuse("size " + std::to_string(bytes) + ", expected " + std::to_string(expected_bytes));
  std::unique_ptr<ShmSegment> seg(new ShmSegment());
  seg->name_ = name;
  seg->dir_ = dir;
  seg->path_ = path;
  seg->size_ = bytes;
  seg->kind_ = kind;
  seg->share_uid_ = owner_uid;
  if (int e = platform::ShmMapping::Map(file, platform::ShmAccess::kReadWrite, bytes,
                                        /*populate=*/true, &seg->mapping_);
      e != 0) {
    seg->unlinked_ = true;  // not ours to remove on this failure: the caller decides
    return refuse(std::string("mmap: ") + std::strerror(e));
  }
  seg->base_ = seg->mapping_->data();
  // Guarded before the first access: a client may truncate its staging segment.
  seg->guard_ = ClientMemoryGuard::Register(seg->base_, bytes, kAdoptedOwner);
  if (seg->guard_ < 0) {
    seg->unlinked_ = true;
    return Status(StatusCode::kResourceExhausted, "cannot adopt " + path + ": guard table full");
  }
  if (lock) seg->locked_ = seg->mapping_->Lock() == 0;
  *out = std::move(seg);
  return Status::Ok();
}

void ShmSegment::SetOwner(uint64_t session_id) {
  ClientMemoryGuard::SetOwner(guard_, session_id);
  if (faulted()) return;  // its pages are the guard's zeros: nothing of it to write
  header()->session_id = session_id;
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
