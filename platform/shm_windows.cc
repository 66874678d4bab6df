// The Windows side of the shm seam (trainstream/platform/shm.h).
//
// Note [Segments on Windows are files with an owner-only DACL]. A segment must
// outlive the daemon that made it (docs/recovery.md: a restarted daemon adopts
// the optimizer state it left), and be found again by listing its directory
// (reclaim). Named sections backed by the paging file (Boost's
// windows_shared_memory) vanish with their last handle, so a segment here is a
// file in `dir`, mapped through a section of that file:
//   POSIX side                          here
//   open(O_CREAT | O_EXCL), mode 0600   CreateFileW(CREATE_NEW) with a protected
//                                         DACL that grants the process's user
//                                         (its token's SID) all access and
//                                         nobody else any: no inherited ACE
//                                         from the directory widens it, as no
//                                         umask narrows 0600
//   O_NOFOLLOW                          FILE_FLAG_OPEN_REPARSE_POINT, and a
//                                         reparse point is refused (ELOOP)
//   unlink; mappings stay valid         a delete with POSIX semantics (NTFS,
//                                         Windows 10 1709 on): the name goes at
//                                         once. Every handle is opened with
//                                         FILE_SHARE_DELETE, so it succeeds
//                                         while open, and a view keeps its
//                                         section (and file) alive. Where the
//                                         system refuses it (older Windows; Wine
//                                         8.0: not implemented), a plain delete:
//                                         the name stays, "delete pending",
//                                         until the last handle closes
//   posix_fallocate                     FileEndOfFileInfo, growing only: NTFS
//                                         allocates a file's clusters when its
//                                         end is set (the file is not sparse),
//                                         so a full volume fails here. Wine maps
//                                         it to ftruncate, which is sparse (and
//                                         has no FileAllocationInfo: "not
//                                         implemented" in wine 8.0)
//   mmap(MAP_SHARED), MAP_POPULATE      CreateFileMappingW of the file's own
//                                         size, MapViewOfFile, and
//                                         PrefetchVirtualMemory
//   mlock                               VirtualLock, with the working set's
//                                         quota raised (Note [Locking memory
//                                         on Windows])
// Boost.Interprocess is not used on this side: it has no call that creates a
// file or sets a DACL, and what remains (one section and one view) is two
// calls. One difference from the POSIX side: a view longer than the file fails
// to map (Windows would grow a read-write file to the view's size, and a
// client's file is not the daemon's to grow), where mmap maps it and faults
// past the end.
// Errors are returned as errno values, translated from GetLastError().
#include <windows.h>
// windows.h first: aclapi.h needs its types.
#include <aclapi.h>

#include <cerrno>
#include <filesystem>
#include <mutex>
#include <new>
#include <vector>

#include "trainstream/platform/shm.h"
#include "windows_common.h"

namespace trainstream::platform {
namespace {

using internal::ErrnoOf;
using internal::LastErrno;
using internal::OwnerOnly;

std::wstring PathOf(const std::string& dir, const std::string& name) {
  return (std::filesystem::path(dir) / name).wstring();
}

constexpr DWORD kShareAll = FILE_SHARE_READ | FILE_SHARE_WRITE | FILE_SHARE_DELETE;

}  // namespace

struct ShmFile::Impl {
  HANDLE file = INVALID_HANDLE_VALUE;
  ~Impl() {
    if (file != INVALID_HANDLE_VALUE) CloseHandle(file);
  }
};

// Every directory holds plain files here: Windows has no shm_open directory.
bool IsSharedMemoryDir(const std::string& /*dir*/) { return false; }

ShmFile::ShmFile() = default;
ShmFile::~ShmFile() = default;
ShmFile::ShmFile(ShmFile&&) noexcept = default;
ShmFile& ShmFile::operator=(ShmFile&&) noexcept = default;

int ShmFile::Create(const std::string& dir, const std::string& name, ShmFile* out) {
  OwnerOnly security;
  if (int err = security.Init()) return err;
  auto impl = std::make_unique<Impl>();
  impl->file = CreateFileW(PathOf(dir, name).c_str(), GENERIC_READ | GENERIC_WRITE, kShareAll,
                           security.attributes(), CREATE_NEW,
                           FILE_ATTRIBUTE_NORMAL | FILE_FLAG_OPEN_REPARSE_POINT, nullptr);
  if (impl->file == INVALID_HANDLE_VALUE) return LastErrno();
  out->impl_ = std::move(impl);
  return 0;
}

int ShmFile::Open(const std::string& dir, const std::string& name, ShmAccess access, ShmFile* out) {
  auto impl = std::make_unique<Impl>();
  const DWORD rights = access == ShmAccess::kReadOnly ? GENERIC_READ : GENERIC_READ | GENERIC_WRITE;
  impl->file = CreateFileW(PathOf(dir, name).c_str(), rights, kShareAll, nullptr, OPEN_EXISTING,
                           FILE_ATTRIBUTE_NORMAL | FILE_FLAG_OPEN_REPARSE_POINT, nullptr);
  if (impl->file == INVALID_HANDLE_VALUE) return LastErrno();
  BY_HANDLE_FILE_INFORMATION info{};
  if (!GetFileInformationByHandle(impl->file, &info)) return LastErrno();
  if (info.dwFileAttributes & FILE_ATTRIBUTE_REPARSE_POINT) return ELOOP;  // as O_NOFOLLOW
  out->impl_ = std::move(impl);
  return 0;
}

int ShmFile::Remove(const std::string& dir, const std::string& name) {
  const std::wstring path = PathOf(dir, name);
  // The link itself, never its target, as unlink.
  HANDLE file = CreateFileW(path.c_str(), DELETE, kShareAll, nullptr, OPEN_EXISTING,
                            FILE_FLAG_OPEN_REPARSE_POINT, nullptr);
  if (file == INVALID_HANDLE_VALUE) return LastErrno();
  // FileDispositionInfoEx (21): Debian 12's MinGW-w64 headers declare it only
  // for an _WIN32_WINNT no Windows version has.
  constexpr auto kDispositionEx = static_cast<FILE_INFO_BY_HANDLE_CLASS>(21);
  FILE_DISPOSITION_INFO_EX posix{FILE_DISPOSITION_FLAG_DELETE |
                                 FILE_DISPOSITION_FLAG_POSIX_SEMANTICS};
  const bool removed = SetFileInformationByHandle(file, kDispositionEx, &posix, sizeof(posix));
  CloseHandle(file);
  if (removed) return 0;
  // The plain delete (delete pending). DeleteFileW, not FileDispositionInfo on
  // the handle: Wine 8.0 refuses the latter for a mapped file (EACCES).
  return DeleteFileW(path.c_str()) ? 0 : LastErrno();
}

int ShmFile::Allocate(uint64_t bytes) {
  if (!impl_) return EBADF;
  uint64_t size = 0;
  if (int err = GetSize(&size)) return err;
  if (size >= bytes) return 0;  // posix_fallocate never shrinks
  FILE_END_OF_FILE_INFO end{};
  end.EndOfFile.QuadPart = static_cast<LONGLONG>(bytes);
  return SetFileInformationByHandle(impl_->file, FileEndOfFileInfo, &end, sizeof(end))
             ? 0
             : LastErrno();
}

int ShmFile::GetSize(uint64_t* bytes) const {
  if (!impl_) return EBADF;
  LARGE_INTEGER size{};
  if (!GetFileSizeEx(impl_->file, &size)) return LastErrno();
  *bytes = static_cast<uint64_t>(size.QuadPart);
  return 0;
}

int ShmFile::OpenForAdoption(const std::string& dir, const std::string& name, ShmFile* out) {
  return Open(dir, name, ShmAccess::kReadWrite, out);
}

int ShmFile::GiveTo(UserId user) {
  if (!impl_) return EBADF;
  return user == CurrentUserId() ? 0 : ENOTSUP;
}

int ShmFile::Describe(ShmFileFacts* out) const {
  if (!impl_) return EBADF;
  BY_HANDLE_FILE_INFORMATION info{};
  if (!GetFileInformationByHandle(impl_->file, &info)) return LastErrno();
  out->regular = (info.dwFileAttributes & (FILE_ATTRIBUTE_DIRECTORY | FILE_ATTRIBUTE_REPARSE_POINT |
                                           FILE_ATTRIBUTE_DEVICE)) == 0;
  out->links = info.nNumberOfLinks;
  out->bytes = (static_cast<uint64_t>(info.nFileSizeHigh) << 32) | info.nFileSizeLow;
  // The owner's relative id, as platform/user.h counts users.
  PSID owner = nullptr;
  PSECURITY_DESCRIPTOR descriptor = nullptr;
  if (GetSecurityInfo(impl_->file, SE_FILE_OBJECT, OWNER_SECURITY_INFORMATION, &owner, nullptr,
                      nullptr, nullptr, &descriptor) != ERROR_SUCCESS) {
    return EACCES;
  }
  const UCHAR count = *GetSidSubAuthorityCount(owner);
  out->owner = count == 0 ? 0 : static_cast<UserId>(*GetSidSubAuthority(owner, count - 1u));
  LocalFree(descriptor);
  return 0;
}

int ShmFile::ShareReadOnly(const std::string&, const std::string&, UserId reader) {
  return reader == CurrentUserId() ? 0 : ENOTSUP;
}

// No descriptor on this side (trainstream/platform/shm.h).
int ShmFile::native_handle() const { return -1; }

struct ShmMapping::Impl {
  void* data = nullptr;
  uint64_t size = 0;
  ~Impl() {
    if (data != nullptr) UnmapViewOfFile(data);
  }
};

ShmMapping::ShmMapping() = default;
ShmMapping::~ShmMapping() = default;

int ShmMapping::Map(const ShmFile& file, ShmAccess access, uint64_t bytes, bool populate,
                    std::unique_ptr<ShmMapping>* out) {
  if (!file.impl_) return EBADF;
  if (bytes == 0) return EINVAL;  // as on the POSIX side: a segment is never empty
  uint64_t size = 0;
  if (int err = file.GetSize(&size)) return err;
  if (bytes > size) return ENXIO;  // never grow the file (Note [Segments on Windows ...])
  const bool read_only = access == ShmAccess::kReadOnly;
  // Size 0: the section is the file's current size.
  HANDLE section = CreateFileMappingW(file.impl_->file, nullptr,
                                      read_only ? PAGE_READONLY : PAGE_READWRITE, 0, 0, nullptr);
  if (section == nullptr) return LastErrno();
  void* data = MapViewOfFile(section, read_only ? FILE_MAP_READ : FILE_MAP_WRITE, 0, 0,
                             static_cast<SIZE_T>(bytes));
  const DWORD error = GetLastError();
  CloseHandle(section);  // the view keeps the section
  if (data == nullptr) return ErrnoOf(error);
  std::unique_ptr<ShmMapping> mapping(new ShmMapping());
  mapping->impl_ = std::make_unique<Impl>();
  mapping->impl_->data = data;
  mapping->impl_->size = bytes;
  if (populate) {
    WIN32_MEMORY_RANGE_ENTRY range{data, static_cast<SIZE_T>(bytes)};
    PrefetchVirtualMemory(GetCurrentProcess(), 1, &range, 0);  // best effort, as MAP_POPULATE
  }
  *out = std::move(mapping);
  return 0;
}

// Note [Locking memory on Windows]. VirtualLock keeps pages in the working
// set, and a process can lock only about as many pages as its minimum working
// set holds (a few hundred KiB by default), where Linux has RLIMIT_MEMLOCK. So
// when the lock fails for the quota, the minimum and the maximum are raised by
// the mapping's size (SetProcessWorkingSetSizeEx, which any user may call for
// their own process; the system refuses a minimum it cannot keep resident) and
// the lock is tried once more. A mutex makes each read-raise-lock one step, so
// two segments locked at once do not both raise from the same old minimum.
// The quota is not given back when a mapping goes (UnmapViewOfFile unlocks its
// pages): the next segment reuses it, and the budget bounds the total.
int ShmMapping::Lock() {
  static std::mutex quota_mu;
  std::lock_guard<std::mutex> lock(quota_mu);
  const SIZE_T bytes = static_cast<SIZE_T>(impl_->size);
  if (VirtualLock(impl_->data, bytes)) return 0;
  if (GetLastError() != ERROR_WORKING_SET_QUOTA) return LastErrno();
  HANDLE self = GetCurrentProcess();
  SIZE_T minimum = 0, maximum = 0;
  DWORD flags = 0;
  if (!GetProcessWorkingSetSizeEx(self, &minimum, &maximum, &flags)) return LastErrno();
  if (!SetProcessWorkingSetSizeEx(self, minimum + bytes, maximum + bytes, flags)) {
    return LastErrno();
  }
  return VirtualLock(impl_->data, bytes) ? 0 : LastErrno();
}

void* ShmMapping::data() const { return impl_->data; }
uint64_t ShmMapping::size() const { return impl_->size; }

}  // namespace trainstream::platform
