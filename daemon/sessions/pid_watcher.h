// PidWatcher: notices a client process's death through pidfd_open + poll, so a
// SIGKILLed client's memory is reclaimed within milliseconds even when gRPC is
// slow to notice the closed connection. One thread for all watched pids.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <thread>

namespace trainstream::daemon {

class PidWatcher {
 public:
  // `on_exit(key)` runs on the watcher thread, with no lock of the watcher held
  // (it may call Unwatch).
  explicit PidWatcher(std::function<void(uint64_t key)> on_exit);
  ~PidWatcher();
  PidWatcher(const PidWatcher&) = delete;
  PidWatcher& operator=(const PidWatcher&) = delete;

  // Watches `pid` under `key`. False when the process does not exist (already
  // gone) or pidfd_open is unavailable (errno says which).
  bool Watch(uint64_t key, pid_t pid);
  void Unwatch(uint64_t key);

 private:
  void Loop();
  void Wake();

  std::function<void(uint64_t)> on_exit_;
  int wake_fd_ = -1;  // eventfd: the watched set changed, or stop
  std::mutex mu_;
  std::map<uint64_t, int> pidfds_;  // key -> pidfd. Guarded by mu_.
  bool stop_ = false;               // Guarded by mu_.
  std::thread thread_;
};

}  // namespace trainstream::daemon
