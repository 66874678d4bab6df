#include "base/model_sources.h"

#include <algorithm>
#include <cerrno>
#include <thread>

#include "trainstream/platform/read_only_file.h"
#include "trainstream/platform/sys_call.h"
#include "trainstream/platform/user.h"

namespace trainstream::daemon::base {
namespace {

constexpr const char* kIndexName = "model.safetensors.index.json";
constexpr uint64_t kMaxIndexBytes = 64ull << 20;

bool EndsWith(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

Status Errno(int err, const std::string& what, const PeerCredentials& caller) {
  if (err == EACCES || err == EPERM) {
    return Status(StatusCode::kPermissionDenied,
                  what + ": permission denied for uid " + std::to_string(caller.uid) +
                      " (the daemon opens base files with the caller's credentials)");
  }
  if (err == ENOENT || err == ENOTDIR) {
    return platform::ErrnoStatus(StatusCode::kNotFound, what, err);
  }
  return platform::ErrnoStatus(StatusCode::kInvalidArgument, what, err);
}

// Opens `name` (under the folder `dir`, or absolute when `dir` is null) as a
// regular file. The seam's open never blocks on a FIFO.
Status OpenRegular(const platform::ReadOnlyFile* dir, const std::string& name,
                   const std::string& label, const PeerCredentials& caller, SourceFile* out) {
  if (int err = platform::ReadOnlyFile::Open(dir, name, &out->file); err != 0)
    return Errno(err, label, caller);
  out->path = label;
  if (!out->file.facts().regular) {
    return Status(StatusCode::kInvalidArgument,
                  label +
                      ": not a regular file (a .safetensors file or a model folder "
                      "is accepted)");
  }
  return Status::Ok();
}

Status OpenFolder(const PeerCredentials& caller, const std::string& dir,
                  const platform::ReadOnlyFile& folder, ModelSources* out) {
  const std::string sep(1, platform::PathSeparator());
  SourceFile index_file;
  Status st = OpenRegular(&folder, kIndexName, dir + sep + kIndexName, caller, &index_file);
  if (st.ok()) {
    if (index_file.file.facts().size > kMaxIndexBytes) {
      return Status(StatusCode::kInvalidArgument, index_file.path + ": larger than " +
                                                      std::to_string(kMaxIndexBytes) +
                                                      " bytes; not a shard index");
    }
    std::string text(static_cast<size_t>(index_file.file.facts().size), '\0');
    size_t done = 0;
    while (done < text.size()) {
      const int64_t r = index_file.file.ReadAt(text.data() + done, text.size() - done, done);
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) return Errno(r < 0 ? errno : EIO, index_file.path, caller);
      done += static_cast<size_t>(r);
    }
    if (Status parsed = ParseShardIndex(index_file.path, text, &out->index); !parsed.ok())
      return parsed;
    if (out->index.shards.size() > kMaxShards) {
      return Status(StatusCode::kInvalidArgument,
                    index_file.path + ": more than " + std::to_string(kMaxShards) + " shards");
    }
    out->has_index = true;
    for (const auto& shard : out->index.shards) {
      SourceFile f;
      st = OpenRegular(&folder, shard, dir + sep + shard, caller, &f);
      if (!st.ok()) {
        return Status(st.code(), st.message() + " (a shard named in " + index_file.path + ")");
      }
      out->files.push_back(std::move(f));
    }
    return Status::Ok();
  }
  if (st.code() != StatusCode::kNotFound) return st;
  SourceFile single;
  st = OpenRegular(&folder, "model.safetensors", dir + sep + "model.safetensors", caller, &single);
  if (st.ok()) {
    out->files.push_back(std::move(single));
    return Status::Ok();
  }
  if (st.code() != StatusCode::kNotFound) return st;
  std::vector<std::string> names;
  const int list_err = folder.ListNames([&names](const std::string& name) {
    if (EndsWith(name, ".safetensors") && name[0] != '.') names.push_back(name);
    return names.size() <= kMaxShards;
  });
  if (list_err != 0) return Errno(list_err, dir, caller);
  if (names.empty()) {
    return Status(StatusCode::kNotFound,
                  dir + ": no " + kIndexName + ", model.safetensors or *.safetensors file");
  }
  if (names.size() > kMaxShards) {
    return Status(StatusCode::kInvalidArgument,
                  dir + ": more than " + std::to_string(kMaxShards) + " .safetensors files");
  }
  std::sort(names.begin(), names.end());
  for (const auto& name : names) {
    SourceFile f;
    st = OpenRegular(&folder, name, dir + sep + name, caller, &f);
    if (!st.ok()) return st;
    out->files.push_back(std::move(f));
  }
  return Status::Ok();
}

Status OpenAll(const PeerCredentials& caller, const std::string& path, ModelSources* out) {
  platform::ReadOnlyFile opened;
  if (int err = platform::ReadOnlyFile::Open(nullptr, path, &opened); err != 0)
    return Errno(err, path, caller);
  if (opened.facts().directory) return OpenFolder(caller, path, opened, out);
  SourceFile f;
  f.path = path;
  if (!opened.facts().regular) {
    return Status(StatusCode::kInvalidArgument,
                  path +
                      ": not a regular file (a .safetensors file or a model folder "
                      "is accepted)");
  }
  f.file = std::move(opened);
  out->files.push_back(std::move(f));
  return Status::Ok();
}

}  // namespace

Status OpenModelAsCaller(const PeerCredentials& caller, const std::string& path,
                         ModelSources* out) {
  *out = ModelSources();
  out->path = path;
  if (path.empty() || !platform::IsAbsolutePath(path) || path.find('\0') != std::string::npos ||
      path.size() > 4096) {
    return Status(StatusCode::kInvalidArgument,
                  "path: '" + path.substr(0, 200) +
                      "' is not an absolute path (give the .safetensors file or the model "
                      "folder as an absolute path)");
  }
  const platform::UserId daemon_uid = platform::CurrentUserId();
  if (daemon_uid != 0 && caller.uid != daemon_uid) {
    return Status(StatusCode::kPermissionDenied,
                  "path: trainstreamd runs as uid " + std::to_string(daemon_uid) +
                      ", not root, so it cannot check what uid " + std::to_string(caller.uid) +
                      " may read; load bases as uid " + std::to_string(daemon_uid) +
                      " or run the daemon as root (the system service)");
  }
  Status result;
  std::thread opener([&] {
    if (daemon_uid == 0 && caller.uid != 0) {
      // Thread-local identity switch; see the Note in model_sources.h.
      if (int err = platform::TakeFilesystemIdentity(caller.uid, caller.gid, caller.groups);
          err != 0) {
        result = platform::ErrnoStatus(StatusCode::kInternal,
                                       "cannot take uid " + std::to_string(caller.uid) +
                                           "'s filesystem credentials to open " + path,
                                       err);
        return;
      }
    }
    result = OpenAll(caller, path, out);
  });
  opener.join();
  if (!result.ok()) out->files.clear();
  return result;
}

}  // namespace trainstream::daemon::base
