// Checkpoint shards for the base-loading tests (safetensors_test, base_fill_test).
#pragma once

#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <utility>

#include "base/model_sources.h"
#include "catch_compat.h"

namespace trainstream::daemon::base::testing {

// Writes `file` to a temporary path and opens it as a shard of the checkpoint
// "/models/m"; the path is unlinked at once (the fd keeps the file).
// `sparse_tail` bytes of hole follow it.
inline void AddShard(const std::string& file, ModelSources* sources, uint64_t sparse_tail = 0) {
  char path[] = "/tmp/ts-shard-XXXXXX";
  SourceFile f;
  f.fd = mkstemp(path);
  REQUIRE(f.fd >= 0);
  f.path = path;
  unlink(path);
  REQUIRE(write(f.fd, file.data(), file.size()) == static_cast<ssize_t>(file.size()));
  if (sparse_tail != 0)
    REQUIRE(ftruncate(f.fd, static_cast<off_t>(file.size() + sparse_tail)) == 0);
  REQUIRE(fstat(f.fd, &f.st) == 0);
  sources->path = "/models/m";
  sources->files.push_back(std::move(f));
}

}  // namespace trainstream::daemon::base::testing
