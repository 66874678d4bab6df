// Checkpoint shards for the base-loading tests (safetensors_test, base_fill_test).
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <utility>

#include "base/model_sources.h"
#include "catch_compat.h"

namespace trainstream::daemon::base::testing {

// Writes `file` to a temporary path and opens it as a shard of the checkpoint
// "/models/m"; the path is unlinked at once (the open file keeps it).
// `sparse_tail` bytes of hole follow it. With `writer`, *writer is a writable
// descriptor of the same file (the caller closes it), for tests that change the
// file under a load.
inline void AddShard(const std::string& file, ModelSources* sources, uint64_t sparse_tail = 0,
                     int* writer = nullptr) {
  char path[] = "/tmp/ts-shard-XXXXXX";
  const int fd = mkstemp(path);
  REQUIRE(fd >= 0);
  REQUIRE(write(fd, file.data(), file.size()) == static_cast<ssize_t>(file.size()));
  if (sparse_tail != 0) REQUIRE(ftruncate(fd, static_cast<off_t>(file.size() + sparse_tail)) == 0);
  SourceFile f;
  f.path = path;
  REQUIRE(platform::ReadOnlyFile::Open(nullptr, path, &f.file) == 0);
  unlink(path);
  if (writer != nullptr) {
    *writer = fd;
  } else {
    close(fd);
  }
  sources->path = "/models/m";
  sources->files.push_back(std::move(f));
}

}  // namespace trainstream::daemon::base::testing
