// The Linux side of the liveness seam (trainstream/platform/process_watcher.h):
// a pidfd per watched process, polled by one thread with an eventfd that says
// the watched set changed.
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "trainstream/platform/process_watcher.h"

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif

namespace trainstream::platform {

struct ProcessWatcher::Impl {
  void Loop();
  void Wake();

  std::function<void(uint64_t)> on_exit;
  int wake_fd = -1;  // eventfd: the watched set changed, or stop
  std::mutex mu;
  std::map<uint64_t, int> pidfds;  // key -> pidfd. Guarded by mu.
  bool stop = false;               // Guarded by mu.
  std::thread thread;
};

ProcessWatcher::ProcessWatcher(std::function<void(uint64_t)> on_exit) : impl_(new Impl) {
  impl_->on_exit = std::move(on_exit);
  impl_->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  impl_->thread = std::thread([impl = impl_.get()] { impl->Loop(); });
}

ProcessWatcher::~ProcessWatcher() {
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->stop = true;
  }
  impl_->Wake();
  impl_->thread.join();
  for (auto& [key, fd] : impl_->pidfds) close(fd);
  close(impl_->wake_fd);
}

void ProcessWatcher::Impl::Wake() {
  uint64_t one = 1;
  ssize_t ignored = write(wake_fd, &one, sizeof(one));
  (void)ignored;
}

bool ProcessWatcher::Watch(uint64_t key, int64_t pid) {
  int fd = static_cast<int>(syscall(SYS_pidfd_open, static_cast<pid_t>(pid), 0));
  if (fd < 0) return false;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    auto it = impl_->pidfds.find(key);
    if (it != impl_->pidfds.end()) close(it->second);
    impl_->pidfds[key] = fd;
  }
  impl_->Wake();
  return true;
}

void ProcessWatcher::Unwatch(uint64_t key) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto it = impl_->pidfds.find(key);
  if (it == impl_->pidfds.end()) return;
  close(it->second);
  impl_->pidfds.erase(it);
  // The loop may still poll the closed fd number; it re-reads the set after
  // every wake, and a stale POLLNVAL is ignored because the key is gone.
  impl_->Wake();
}

void ProcessWatcher::Impl::Loop() {
  std::vector<pollfd> fds;
  std::vector<uint64_t> keys;
  for (;;) {
    fds.assign(1, pollfd{wake_fd, POLLIN, 0});
    keys.assign(1, 0);
    {
      std::lock_guard<std::mutex> lock(mu);
      if (stop) return;
      for (auto& [key, fd] : pidfds) {
        fds.push_back(pollfd{fd, POLLIN, 0});
        keys.push_back(key);
      }
    }
    int n = poll(fds.data(), fds.size(), -1);
    if (n < 0 && errno != EINTR) return;
    if (fds[0].revents != 0) {
      uint64_t v;
      ssize_t ignored = read(wake_fd, &v, sizeof(v));
      (void)ignored;
    }
    std::vector<uint64_t> exited;
    {
      std::lock_guard<std::mutex> lock(mu);
      for (size_t i = 1; i < fds.size(); ++i) {
        if ((fds[i].revents & POLLIN) == 0) continue;
        auto it = pidfds.find(keys[i]);
        if (it == pidfds.end() || it->second != fds[i].fd) continue;  // unwatched meanwhile
        close(it->second);
        pidfds.erase(it);
        exited.push_back(keys[i]);
      }
    }
    for (uint64_t key : exited) on_exit(key);
  }
}

// Moved from the daemon's recovery/owner.cc.
uint64_t ProcessStartTime(int64_t pid) {
  if (pid <= 0) return 0;
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  // "pid (comm) state ppid ...": comm may hold spaces and ')', so fields count
  // from the last ')'. After it come field 3 (state) .. field 22 (starttime).
  const size_t close = text.rfind(')');
  if (close == std::string::npos) return 0;
  std::istringstream fields(text.substr(close + 1));
  std::string field;
  for (int i = 3; i <= 22; ++i) {
    if (!(fields >> field)) return 0;
    if (i == 3 && (field == "Z" || field == "X")) return 0;  // exited, not yet reaped
  }
  return std::strtoull(field.c_str(), nullptr, 10);
}

int64_t SessionProcess(int64_t kernel_pid, int64_t) { return kernel_pid; }

}  // namespace trainstream::platform
