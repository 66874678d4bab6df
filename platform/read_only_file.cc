// The platform-independent part of ReadOnlyFile (read_only_file.h): ownership of the
// handle. Opening, reading and closing are in read_only_file_{linux,windows}.cc.
#include "trainstream/platform/read_only_file.h"

#include <utility>

namespace trainstream::platform {

ReadOnlyFile::~ReadOnlyFile() { Close(); }

ReadOnlyFile::ReadOnlyFile(ReadOnlyFile&& o) noexcept
    : handle_(o.handle_), path_(std::move(o.path_)), facts_(o.facts_) {
  o.handle_ = kNone;
}

ReadOnlyFile& ReadOnlyFile::operator=(ReadOnlyFile&& o) noexcept {
  if (this != &o) {
    Close();
    handle_ = o.handle_;
    path_ = std::move(o.path_);
    facts_ = o.facts_;
    o.handle_ = kNone;
  }
  return *this;
}

}  // namespace trainstream::platform
