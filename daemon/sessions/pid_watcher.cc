#include "sessions/pid_watcher.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <utility>
#include <vector>

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif

namespace trainstream::daemon {

PidWatcher::PidWatcher(std::function<void(uint64_t)> on_exit) : on_exit_(std::move(on_exit)) {
  wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  thread_ = std::thread([this] { Loop(); });
}

PidWatcher::~PidWatcher() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  Wake();
  thread_.join();
  for (auto& [key, fd] : pidfds_) close(fd);
  close(wake_fd_);
}

void PidWatcher::Wake() {
  uint64_t one = 1;
  ssize_t ignored = write(wake_fd_, &one, sizeof(one));
  (void)ignored;
}

bool PidWatcher::Watch(uint64_t key, pid_t pid) {
  int fd = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
  if (fd < 0) return false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pidfds_.find(key);
    if (it != pidfds_.end()) close(it->second);
    pidfds_[key] = fd;
  }
  Wake();
  return true;
}

void PidWatcher::Unwatch(uint64_t key) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = pidfds_.find(key);
  if (it == pidfds_.end()) return;
  close(it->second);
  pidfds_.erase(it);
  // The loop may still poll the closed fd number; it re-reads the set after
  // every wake, and a stale POLLNVAL is ignored because the key is gone.
  uint64_t one = 1;
  ssize_t ignored = write(wake_fd_, &one, sizeof(one));
  (void)ignored;
}

void PidWatcher::Loop() {
  std::vector<pollfd> fds;
  std::vector<uint64_t> keys;
  for (;;) {
    fds.assign(1, pollfd{wake_fd_, POLLIN, 0});
    keys.assign(1, 0);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) return;
      for (auto& [key, fd] : pidfds_) {
        fds.push_back(pollfd{fd, POLLIN, 0});
        keys.push_back(key);
      }
    }
    int n = poll(fds.data(), fds.size(), -1);
    if (n < 0 && errno != EINTR) return;
    if (fds[0].revents != 0) {
      uint64_t v;
      ssize_t ignored = read(wake_fd_, &v, sizeof(v));
      (void)ignored;
    }
    std::vector<uint64_t> exited;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (size_t i = 1; i < fds.size(); ++i) {
        if ((fds[i].revents & POLLIN) == 0) continue;
        auto it = pidfds_.find(keys[i]);
        if (it == pidfds_.end() || it->second != fds[i].fd) continue;  // unwatched meanwhile
        close(it->second);
        pidfds_.erase(it);
        exited.push_back(keys[i]);
      }
    }
    for (uint64_t key : exited) on_exit_(key);
  }
}

}  // namespace trainstream::daemon
