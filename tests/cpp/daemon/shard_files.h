// Checkpoint shards for the base-loading tests (safetensors_test, base_fill_test).
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>

#include "base/model_sources.h"
#include "catch_compat.h"

namespace trainstream::daemon::base::testing {

// Writes `path` (binary).
inline void WriteWholeFile(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  REQUIRE(out.good());
}

// A new temporary file's path. MinGW's mkstemp opens the file sharing it with
// no other opener, so tests write and open it by name instead.
inline std::string NewTemporaryFile(const char* prefix) {
  std::string path = std::string("/tmp/") + prefix + "-XXXXXX";
  const int fd = mkstemp(path.data());
  REQUIRE(fd >= 0);
  close(fd);
  return path;
}

// Writes `file` to a temporary path and opens it as a shard of the checkpoint
// "/models/m"; the path is removed at once (the open file keeps it; on Windows
// the name goes when the last handle closes). `sparse_tail` bytes of hole
// follow it. With `writer`, *writer is a writable descriptor of the same file
// (the caller closes it), for tests that change the file under a load.
inline void AddShard(const std::string& file, ModelSources* sources, uint64_t sparse_tail = 0,
                     int* writer = nullptr) {
  const std::string path = NewTemporaryFile("ts-shard");
  WriteWholeFile(path, file);
  if (sparse_tail != 0) std::filesystem::resize_file(path, file.size() + sparse_tail);
  if (writer != nullptr) {
    *writer = open(path.c_str(), O_RDWR);
    REQUIRE(*writer >= 0);
  }
  SourceFile f;
  f.path = path;
  REQUIRE(platform::ReadOnlyFile::Open(nullptr, path, &f.file) == 0);
  std::remove(path.c_str());
  sources->path = "/models/m";
  sources->files.push_back(std::move(f));
}

}  // namespace trainstream::daemon::base::testing
