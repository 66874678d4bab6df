#include "base/model_sources.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

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
    return Status(StatusCode::kNotFound, what + ": " + std::strerror(err));
  }
  return Status(StatusCode::kInvalidArgument, what + ": " + std::strerror(err));
}

// Opens `name` (relative to `dirfd`, or absolute) as a regular file. O_NONBLOCK
// so that a FIFO cannot park the daemon's thread in open().
Status OpenRegular(int dirfd, const std::string& name, const std::string& label,
                   const PeerCredentials& caller, SourceFile* out) {
  const int fd = openat(dirfd, name.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
  if (fd < 0) return Errno(errno, label, caller);
  out->fd = fd;
  out->path = label;
  if (fstat(fd, &out->st) != 0) return Errno(errno, label, caller);
  if (!S_ISREG(out->st.st_mode)) {
    return Status(StatusCode::kInvalidArgument,
                  label +
                      ": not a regular file (a .safetensors file or a model folder "
                      "is accepted)");
  }
  // Back to blocking reads.
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  return Status::Ok();
}

Status OpenFolder(const PeerCredentials& caller, const std::string& dir, int dirfd,
                  ModelSources* out) {
  SourceFile index_file;
  Status st = OpenRegular(dirfd, kIndexName, dir + "/" + kIndexName, caller, &index_file);
  if (st.ok()) {
    if (static_cast<uint64_t>(index_file.st.st_size) > kMaxIndexBytes) {
      return Status(StatusCode::kInvalidArgument, index_file.path + ": larger than " +
                                                      std::to_string(kMaxIndexBytes) +
                                                      " bytes; not a shard index");
    }
    std::string text(static_cast<size_t>(index_file.st.st_size), '\0');
    size_t done = 0;
    while (done < text.size()) {
      const ssize_t r =
          pread(index_file.fd, text.data() + done, text.size() - done, static_cast<off_t>(done));
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
      st = OpenRegular(dirfd, shard, dir + "/" + shard, caller, &f);
      if (!st.ok()) {
        return Status(st.code(), st.message() + " (a shard named in " + index_file.path + ")");
      }
      out->files.push_back(std::move(f));
    }
    return Status::Ok();
  }
  if (st.code() != StatusCode::kNotFound) return st;
  SourceFile single;
  st = OpenRegular(dirfd, "model.safetensors", dir + "/model.safetensors", caller, &single);
  if (st.ok()) {
    out->files.push_back(std::move(single));
    return Status::Ok();
  }
  if (st.code() != StatusCode::kNotFound) return st;
  const int listfd = dup(dirfd);
  DIR* d = listfd >= 0 ? fdopendir(listfd) : nullptr;
  if (d == nullptr) {
    if (listfd >= 0) close(listfd);
    return Errno(errno, dir, caller);
  }
  std::vector<std::string> names;
  while (dirent* e = readdir(d)) {
    std::string name = e->d_name;
    if (EndsWith(name, ".safetensors") && name[0] != '.') names.push_back(name);
    if (names.size() > kMaxShards) break;
  }
  closedir(d);
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
    st = OpenRegular(dirfd, name, dir + "/" + name, caller, &f);
    if (!st.ok()) return st;
    out->files.push_back(std::move(f));
  }
  return Status::Ok();
}

Status OpenAll(const PeerCredentials& caller, const std::string& path, ModelSources* out) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
  if (fd < 0) return Errno(errno, path, caller);
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    close(fd);
    return Errno(err, path, caller);
  }
  if (S_ISDIR(st.st_mode)) {
    Status s = OpenFolder(caller, path, fd, out);
    close(fd);
    return s;
  }
  close(fd);
  SourceFile f;
  Status s = OpenRegular(AT_FDCWD, path, path, caller, &f);
  if (!s.ok()) return s;
  out->files.push_back(std::move(f));
  return Status::Ok();
}

}  // namespace

SourceFile::SourceFile(SourceFile&& o) noexcept : path(std::move(o.path)), fd(o.fd), st(o.st) {
  o.fd = -1;
}

SourceFile& SourceFile::operator=(SourceFile&& o) noexcept {
  if (this != &o) {
    if (fd >= 0) close(fd);
    path = std::move(o.path);
    fd = o.fd;
    st = o.st;
    o.fd = -1;
  }
  return *this;
}

SourceFile::~SourceFile() {
  if (fd >= 0) close(fd);
}

Status OpenModelAsCaller(const PeerCredentials& caller, const std::string& path,
                         ModelSources* out) {
  *out = ModelSources();
  out->path = path;
  if (path.empty() || path[0] != '/' || path.find('\0') != std::string::npos ||
      path.size() > 4096) {
    return Status(StatusCode::kInvalidArgument,
                  "path: '" + path.substr(0, 200) +
                      "' is not an absolute path (give the .safetensors file or the model "
                      "folder as an absolute path)");
  }
  const platform::UserId daemon_uid = geteuid();
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
      std::vector<platform::GroupId> groups = caller.groups;
      if (syscall(SYS_setgroups, groups.size(), groups.data()) != 0 ||
          syscall(SYS_setfsgid, caller.gid) < 0 || syscall(SYS_setfsuid, caller.uid) < 0 ||
          static_cast<platform::UserId>(syscall(SYS_setfsuid, static_cast<platform::UserId>(-1))) !=
              caller.uid ||
          static_cast<platform::GroupId>(
              syscall(SYS_setfsgid, static_cast<platform::GroupId>(-1))) != caller.gid) {
        result = Status(StatusCode::kInternal, "cannot take uid " + std::to_string(caller.uid) +
                                                   "'s filesystem credentials to open " + path +
                                                   ": " + std::strerror(errno));
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
