#include <cerrno>
#include <cstdint>

#include "trainstream/client.h"
#include "trainstream/platform/shm.h"
#include "trainstream/platform/sys_call.h"

namespace trainstream {

// Opening and mapping go through the platform seam, Boost.Interprocess on the
// daemon's shm directory (Note [Segments through Boost.Interprocess]).
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
  const auto access =
      info.read_only ? platform::ShmAccess::kReadOnly : platform::ShmAccess::kReadWrite;
  platform::ShmFile file;
  if (int err = platform::ShmFile::Open(shm_dir, info.segment_name, access, &file); err != 0) {
    return platform::ErrnoStatus(
        err == EACCES || err == EPERM ? StatusCode::kPermissionDenied : StatusCode::kNotFound,
        "cannot open segment " + path, err);
  }
  uint64_t file_size = 0;
  if (file.GetSize(&file_size) != 0 || file_size < info.segment_size) {
    return Status(StatusCode::kInternal, "segment " + path + " is smaller than the daemon said");
  }
  // The mapping outlives `file`, whose handle closes on return.
  std::unique_ptr<platform::ShmMapping> mapping;
  if (int err =
          platform::ShmMapping::Map(file, access, info.segment_size, /*populate=*/false, &mapping);
      err != 0) {
    return platform::ErrnoStatus(StatusCode::kInternal, "mmap " + path, err);
  }
  out->reset(new MappedRegion(info, std::move(mapping)));
  return Status::Ok();
}

MappedRegion::MappedRegion(RegionInfo info, std::unique_ptr<platform::ShmMapping> mapping)
    : info_(std::move(info)), mapping_(std::move(mapping)), base_(mapping_->data()) {}

MappedRegion::~MappedRegion() = default;

}  // namespace trainstream
