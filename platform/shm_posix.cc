// The POSIX side of the shm seam (Note [Segments through Boost.Interprocess],
// trainstream/platform/shm.h). The Windows side is shm_windows.cc.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <boost/interprocess/exceptions.hpp>
#include <boost/interprocess/mapped_region.hpp>
#include <boost/interprocess/shared_memory_object.hpp>
#include <cerrno>
#include <new>
#include <string>
#include <utility>

#include "trainstream/platform/shm.h"

namespace trainstream::platform {

namespace bip = boost::interprocess;

namespace {

// shm_open's directory on Linux (glibc: SHMDIR), where shared_memory_object lives.
constexpr const char kSharedMemoryDir[] = "/dev/shm";
constexpr mode_t kSegmentMode = 0600;

// The errno behind a Boost failure: its native error when it came from a
// system call, else the nearest errno for Boost's own code.
int ErrnoOf(const bip::interprocess_exception& e) {
  if (e.get_native_error() != 0) return e.get_native_error();
  switch (e.get_error_code()) {
    case bip::already_exists_error:
      return EEXIST;
    case bip::not_found_error:
      return ENOENT;
    case bip::security_error:
      return EACCES;
    case bip::out_of_memory_error:
      return ENOMEM;
    default:
      return EINVAL;
  }
}

// Runs `f`, which may throw what Boost throws; returns 0 or the errno.
template <class F>
int CallBoost(F&& f) {
  try {
    f();
    return 0;
  } catch (const bip::interprocess_exception& e) {
    return ErrnoOf(e);
  } catch (const std::bad_alloc&) {
    return ENOMEM;
  }
}

bip::mode_t BoostMode(ShmAccess access) {
  return access == ShmAccess::kReadOnly ? bip::read_only : bip::read_write;
}

// A descriptor opened by path, as a Boost "memory mappable" object:
// mapped_region asks it for nothing but its mapping handle.
struct DescriptorMappable {
  int fd;
  bip::mapping_handle_t get_mapping_handle() const {
    bip::mapping_handle_t h{};
    h.handle = fd;
    return h;
  }
};

}  // namespace

// Exactly one of the two is open: `shm` in /dev/shm, `fd` elsewhere.
struct ShmFile::Impl {
  bip::shared_memory_object shm;
  int fd = -1;
  ~Impl() {
    if (fd >= 0) close(fd);
  }
  int handle() const { return fd >= 0 ? fd : shm.get_mapping_handle().handle; }
};

bool IsSharedMemoryDir(const std::string& dir) { return dir == kSharedMemoryDir; }

ShmFile::ShmFile() = default;
ShmFile::~ShmFile() = default;
ShmFile::ShmFile(ShmFile&&) noexcept = default;
ShmFile& ShmFile::operator=(ShmFile&&) noexcept = default;

int ShmFile::Create(const std::string& dir, const std::string& name, ShmFile* out) {
  auto impl = std::make_unique<Impl>();
  if (IsSharedMemoryDir(dir)) {
    // create_only: O_CREAT | O_EXCL; Boost fchmods to the permissions after
    // shm_open, so the umask cannot narrow 0600.
    if (int err = CallBoost([&] {
          impl->shm = bip::shared_memory_object(bip::create_only, name.c_str(), bip::read_write,
                                                bip::permissions(kSegmentMode));
        })) {
      return err;
    }
  } else {
    impl->fd = open((dir + "/" + name).c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW,
                    kSegmentMode);
    if (impl->fd < 0) return errno;
    // As Boost does for its own: the mode is 0600 whatever the umask.
    if (fchmod(impl->fd, kSegmentMode) != 0) {
      const int err = errno;
      unlink((dir + "/" + name).c_str());
      return err;
    }
  }
  out->impl_ = std::move(impl);
  return 0;
}

int ShmFile::Open(const std::string& dir, const std::string& name, ShmAccess access, ShmFile* out) {
  auto impl = std::make_unique<Impl>();
  if (IsSharedMemoryDir(dir)) {
    if (int err = CallBoost([&] {
          impl->shm = bip::shared_memory_object(bip::open_only, name.c_str(), BoostMode(access));
        })) {
      return err;
    }
  } else {
    impl->fd = open((dir + "/" + name).c_str(),
                    (access == ShmAccess::kReadOnly ? O_RDONLY : O_RDWR) | O_CLOEXEC | O_NOFOLLOW);
    if (impl->fd < 0) return errno;
  }
  out->impl_ = std::move(impl);
  return 0;
}

int ShmFile::Remove(const std::string& dir, const std::string& name) {
  if (IsSharedMemoryDir(dir)) {
    errno = 0;
    if (bip::shared_memory_object::remove(name.c_str())) return 0;
    return errno != 0 ? errno : ENOENT;
  }
  return unlink((dir + "/" + name).c_str()) == 0 ? 0 : errno;
}

int ShmFile::Allocate(uint64_t bytes) {
  if (!impl_) return EBADF;
  // posix_fallocate returns its error rather than setting errno.
  return posix_fallocate(impl_->handle(), 0, static_cast<off_t>(bytes));
}

int ShmFile::GetSize(uint64_t* bytes) const {
  if (!impl_) return EBADF;
  struct stat st {};
  if (fstat(impl_->handle(), &st) != 0) return errno;
  *bytes = static_cast<uint64_t>(st.st_size);
  return 0;
}

namespace {

// A "system.posix_acl_access" value (the kernel's xattr ACL format, version 2:
// entries of tag, permission and id): user::`perm`, user:<uid>:`perm`,
// group::-, mask::`perm`, other::-. (The daemon's shm_segment.cc, moved.)
std::string AclFor(UserId uid, uint16_t perm) {
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

}  // namespace

int ShmFile::OpenForAdoption(const std::string& dir, const std::string& name, ShmFile* out) {
  int err = Open(dir, name, ShmAccess::kReadWrite, out);
  if (err == EACCES && geteuid() == 0) {
    // A client's 0600 session segment and a root daemon without
    // CAP_DAC_OVERRIDE (the systemd unit): CAP_FOWNER may still name root in
    // the file's ACL, and then it opens.
    const std::string acl = AclFor(0, 6);
    const std::string path = dir + "/" + name;
    if (setxattr(path.c_str(), "system.posix_acl_access", acl.data(), acl.size(), 0) == 0)
      err = Open(dir, name, ShmAccess::kReadWrite, out);
  }
  return err;
}

int ShmFile::GiveTo(UserId user) {
  if (!impl_) return EBADF;
  return fchown(impl_->handle(), user, static_cast<gid_t>(-1)) == 0 ? 0 : errno;
}

int ShmFile::Describe(ShmFileFacts* out) const {
  if (!impl_) return EBADF;
  struct stat st {};
  if (fstat(impl_->handle(), &st) != 0) return errno;
  out->regular = S_ISREG(st.st_mode);
  out->links = static_cast<uint64_t>(st.st_nlink);
  out->owner = st.st_uid;
  out->bytes = static_cast<uint64_t>(st.st_size);
  return 0;
}

int ShmFile::ShareReadOnly(const std::string& dir, const std::string& name, UserId reader) {
  // Ownership and ACLs are POSIX, by path (Note [Segments through
  // Boost.Interprocess]).
  const std::string path = dir + "/" + name;
  if (geteuid() == 0 && reader != 0) {
    const std::string acl = AclFor(reader, 4);
    if (chmod(path.c_str(), 0440) == 0 &&
        setxattr(path.c_str(), "system.posix_acl_access", acl.data(), acl.size(), 0) == 0) {
      return 0;
    }
    // No ACLs here: the old way, the reader's own file at 0400.
    if (chown(path.c_str(), reader, static_cast<gid_t>(-1)) != 0) return errno;
  }
  return chmod(path.c_str(), 0400) == 0 ? 0 : errno;
}

int ShmFile::native_handle() const { return impl_ ? impl_->handle() : -1; }

struct ShmMapping::Impl {
  bip::mapped_region region;
};

ShmMapping::ShmMapping() = default;
ShmMapping::~ShmMapping() = default;

int ShmMapping::Map(const ShmFile& file, ShmAccess access, uint64_t bytes, bool populate,
                    std::unique_ptr<ShmMapping>* out) {
  if (!file.impl_) return EBADF;
  // mapped_region takes size 0 as "the whole file"; a segment is never empty.
  if (bytes == 0) return EINVAL;
  std::unique_ptr<ShmMapping> mapping(new ShmMapping());
  mapping->impl_ = std::make_unique<Impl>();
  // Boost adds MAP_SHARED for read_only and read_write; the options are the rest
  // of mmap's flags (default_map_options would be none on Linux).
  const bip::map_options_t options = populate ? MAP_POPULATE : bip::default_map_options;
  const auto size = static_cast<std::size_t>(bytes);
  bip::mapped_region& region = mapping->impl_->region;
  if (int err = CallBoost([&] {
        if (file.impl_->fd >= 0) {
          region = bip::mapped_region(DescriptorMappable{file.impl_->fd}, BoostMode(access), 0,
                                      size, nullptr, options);
        } else {
          region =
              bip::mapped_region(file.impl_->shm, BoostMode(access), 0, size, nullptr, options);
        }
      })) {
    return err;
  }
  *out = std::move(mapping);
  return 0;
}

// Boost has no call for it; mlock on the region's address.
int ShmMapping::Lock() {
  return mlock(impl_->region.get_address(), impl_->region.get_size()) == 0 ? 0 : errno;
}

void* ShmMapping::data() const { return impl_->region.get_address(); }
uint64_t ShmMapping::size() const { return impl_->region.get_size(); }

}  // namespace trainstream::platform
