#include "memory/shm_segment.h"

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <new>
#include <string>
#include <vector>

#include "memory/budget.h"
#include "memory/client_memory_guard.h"
#include "security/token.h"
#include "trainstream/human_bytes.h"
#include "trainstream/platform/files.h"
#include "trainstream/platform/machine.h"
#include "trainstream/platform/shm.h"
#include "trainstream/platform/sys_call.h"
#include "trainstream/platform/user.h"
#include "trainstream/v1/control.pb.h"

namespace trainstream::daemon {

// Note [Segment kind numbers are the wire's]: a segment's kind, a
// trainstream.v1.SegmentKind here, is written into its header as the wire's.
static_assert(static_cast<uint32_t>(wire::SegmentKind::kBase) == v1::SEGMENT_KIND_BASE);
static_assert(static_cast<uint32_t>(wire::SegmentKind::kSession) == v1::SEGMENT_KIND_SESSION);
static_assert(static_cast<uint32_t>(wire::SegmentKind::kState) == v1::SEGMENT_KIND_STATE);

namespace {

std::string g_segment_tag;  // set once at startup (SetSegmentTag)

// The segment header at the start of the regular file `path`, read without a
// mapping (Note [Segments through Boost.Interprocess]) and without following a
// link. False when it cannot be read or is not a segment's.
bool PeekSegmentHeader(const std::string& path, wire::SegmentHeader* h) {
  std::string head;
  if (platform::ReadFilePrefix(path, sizeof(*h), &head) != 0 || head.size() != sizeof(*h)) {
    return false;
  }
  std::memcpy(static_cast<void*>(h), head.data(), sizeof(*h));
  return h->magic == wire::kSegmentMagic;
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

ReclaimResult ReclaimSegments(const std::string& dir, const std::string& tag,
                              const std::set<std::string>& keep) {
  ReclaimResult out;
  const std::string prefix = "trainstream-" + tag + "-";
  std::vector<platform::DirectoryEntry> entries;
  if (int err = platform::ListDirectory(dir, &entries); err != 0) {
    out.error = platform::ErrnoText("cannot list " + dir, err);
    return out;
  }
  for (const auto& e : entries) {
    const std::string& name = e.name;
    if (name.compare(0, prefix.size(), prefix) != 0 || keep.count(name) != 0) continue;
    // The listing's kind, not the file: the systemd unit's root lacks
    // CAP_DAC_OVERRIDE, so a client's 0600 session segment may not open, but it
    // still unlinks (CAP_FOWNER in the sticky /dev/shm). Links are left alone.
    if (e.kind != platform::FileKind::kRegular) continue;
    const std::string path = dir + "/" + name;
    wire::SegmentHeader h{};
    const bool has_header = PeekSegmentHeader(path, &h);
    if (int err = platform::RemoveFile(path); err != 0) {
      if (out.error.empty()) out.error = platform::ErrnoText("cannot remove " + path, err);
      continue;
    }
    ++out.files;
    out.bytes += e.size;
    if (has_header && h.kind == v1::SEGMENT_KIND_STATE) ++out.state_segments;
  }
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
    return platform::ErrnoStatus(code, "cannot create segment " + path, err);
  }
  // The file is ours now: from here on, destroying `seg` unlinks it.
  seg->dir_ = dir;
  seg->path_ = path;
  seg->share_uid_ = owner.uid;
  int rc = file.Allocate(total_bytes);
  if (rc != 0) {
    uint64_t free_bytes = 0, fs_total = 0;
    FilesystemSpace(dir, &free_bytes, &fs_total);
    std::string msg =
        platform::ErrnoText("cannot allocate " + std::to_string(total_bytes) + " bytes (" +
                                HumanBytes(total_bytes) + ") in " + dir + ": posix_fallocate",
                            rc) +
        "; " + dir + " has " + std::to_string(free_bytes) + " bytes (" + HumanBytes(free_bytes) +
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
    return platform::ErrnoStatus(StatusCode::kInternal, "mmap " + seg->path_, err);
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
  if (kind == v1::SEGMENT_KIND_SESSION && platform::RunsPrivileged() && owner.uid != 0) {
    if (int err = file.GiveTo(owner.uid); err != 0) {
      return platform::ErrnoStatus(
          StatusCode::kInternal,
          "cannot give " + seg->path_ + " to uid " + std::to_string(owner.uid), err);
    }
  }
  *out = std::move(seg);
  return Status::Ok();
}

Status ShmSegment::ShareReadOnly() {
  // Note [Why base segments are read-only] (wire/base_manifest.h).
  if (int err = platform::ShmFile::ShareReadOnly(dir_, name_, share_uid_); err != 0) {
    return platform::ErrnoStatus(StatusCode::kInternal, "cannot make " + path_ + " read-only", err);
  }
  return Status::Ok();
}

Status ShmSegment::Adopt(const std::string& dir, const std::string& name, uint32_t kind,
                         platform::UserId owner_uid, uint64_t expected_bytes, bool lock,
                         std::unique_ptr<ShmSegment>* out) {
  const std::string path = dir + "/" + name;
  auto refuse = [&](const std::string& why) {
    return Status(StatusCode::kFailedPrecondition, "cannot adopt " + path + ": " + why);
  };
  platform::ShmFile file;
  if (int err = platform::ShmFile::OpenForAdoption(dir, name, &file); err != 0) {
    return refuse(platform::ErrnoMessage(err));
  }
  platform::ShmFileFacts facts;
  if (int err = file.Describe(&facts); err != 0) return refuse(platform::ErrnoMessage(err));
  if (!facts.regular) return refuse("not a regular file");
  if (facts.links != 1) return refuse("it has " + std::to_string(facts.links) + " links");
  if (facts.owner != owner_uid)
    return refuse("owned by uid " + std::to_string(facts.owner) + ", expected uid " +
                  std::to_string(owner_uid));
  const uint64_t bytes = facts.bytes;
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
    return refuse(platform::ErrnoText("mmap", e));
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
    mapping_.reset();  // unmapping unlocks what Lock() locked
  }
}

}  // namespace trainstream::daemon
