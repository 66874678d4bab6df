#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>

#include "trainstream/client.h"

namespace trainstream {

Status MappedRegion::Map(const std::string& shm_dir, const RegionInfo& info,
                         std::unique_ptr<MappedRegion>* out) {
  if (info.segment_name.empty() || info.segment_name.find('/') != std::string::npos) {
    return Status(StatusCode::kInvalidArgument,
                  "segment_name: '" + info.segment_name + "' is not a segment name");
  }
  if (info.offset > info.segment_size || info.length > info.segment_size - info.offset) {
    return Status(StatusCode::kInvalidArgument, "region [" + std::to_string(info.offset) + ", +" +
                                                    std::to_string(info.length) +
                                                    ") lies outside its segment of " +
                                                    std::to_string(info.segment_size) + " bytes");
  }
  const std::string path = shm_dir + "/" + info.segment_name;
  int fd = open(path.c_str(), (info.read_only ? O_RDONLY : O_RDWR) | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) {
    const int err = errno;
    return Status(
        err == EACCES || err == EPERM ? StatusCode::kPermissionDenied : StatusCode::kNotFound,
        "cannot open segment " + path + ": " + std::strerror(err));
  }
  struct stat st {};
  if (fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_size) < info.segment_size) {
    close(fd);
    return Status(StatusCode::kInternal, "segment " + path + " is smaller than the daemon said");
  }
  const int prot = info.read_only ? PROT_READ : PROT_READ | PROT_WRITE;
  void* base = mmap(nullptr, info.segment_size, prot, MAP_SHARED, fd, 0);
  const int err = errno;
  close(fd);
  if (base == MAP_FAILED)
    return Status(StatusCode::kInternal, "mmap " + path + ": " + std::strerror(err));
  out->reset(new MappedRegion(info, base, info.segment_size));
  return Status::Ok();
}

MappedRegion::~MappedRegion() {
  if (base_ != nullptr) munmap(base_, mapped_);
}

}  // namespace trainstream
