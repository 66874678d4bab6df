// Opening a checkpoint with the caller's rights, not the daemon's.
//
// Note [Caller credentials for base paths]: a client names a path; the daemon
// (often root) must not read a file for a caller who could not read it. So every
// open() and directory listing of a LoadBase request runs in a short-lived
// thread that first switches that thread's filesystem identity to the caller's
// SO_PEERCRED uid, gid and supplementary groups (raw setgroups/setfsgid/setfsuid
// syscalls: they act on the calling thread only, unlike glibc's wrappers for
// setgroups, which broadcast to every thread). The kernel then applies the usual
// permission checks, ACLs and LSMs included, to every component of the path. The
// thread ends after opening; the file descriptors it returns are what the daemon
// reads. A daemon that is not root cannot switch identity, so it serves only
// callers of its own uid (everyone else gets PERMISSION_DENIED saying why).
// The opens, reads and the switch go through platform/read_only_file.h. On
// Windows every caller is the daemon's own user (the endpoint secret,
// Note [Callers without a connection identity]), so there is no switch, and
// links are never followed.
//
// Accepted paths: an absolute path to a `.safetensors` file, or to a folder
// holding `model.safetensors.index.json` (its shards named in weight_map), else
// `model.safetensors`, else every `*.safetensors` file in it.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "base/safetensors.h"
#include "security/caller.h"
#include "trainstream/platform/read_only_file.h"
#include "trainstream/status.h"

namespace trainstream::daemon::base {

inline constexpr size_t kMaxShards = 4096;

// One opened file (move-only: `file` owns its descriptor or handle).
struct SourceFile {
  std::string path;
  platform::ReadOnlyFile file;  // its facts: what it was when opened
};

struct ModelSources {
  std::string path;               // as the caller named it
  std::vector<SourceFile> files;  // sorted by path
  bool has_index = false;
  ShardIndex index;  // when has_index
};

// Opens the checkpoint at `path` as `caller` (see the Note). Errors:
// INVALID_ARGUMENT (not absolute, not a regular file or folder, bad index),
// NOT_FOUND, PERMISSION_DENIED (naming the uid and the path).
Status OpenModelAsCaller(const PeerCredentials& caller, const std::string& path, ModelSources* out);

}  // namespace trainstream::daemon::base
