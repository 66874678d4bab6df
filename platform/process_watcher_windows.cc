// The Windows side of the liveness seam (trainstream/platform/process_watcher.h).
//
// Note [Process exits through the thread pool]: a process handle is signalled
// when the process exits, but one thread can wait on at most 64 handles
// (MAXIMUM_WAIT_OBJECTS), fewer than a daemon's sessions may be. So each watch
// is a RegisterWaitForSingleObject on the system thread pool, whose callback
// only queues (key, generation) and sets the watcher's event; the watcher's own
// thread takes the queue and runs on_exit, as the Linux side does, so on_exit
// may call Unwatch. The generation tells a queued exit of an earlier watch of
// the same key, replaced or unwatched meanwhile, from the current one. A wait
// is unregistered with UnregisterWaitEx(INVALID_HANDLE_VALUE), which returns
// once its callback is not running, and never with mu held: the callback
// takes mu.
#include <windows.h>

#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "trainstream/platform/process_watcher.h"

namespace trainstream::platform {

struct ProcessWatcher::Impl {
  // One watch: the process handle, its thread-pool wait, and what the callback
  // reports. Owned by `watches` until it is released.
  struct Watched {
    Impl* impl = nullptr;
    uint64_t key = 0;
    uint64_t generation = 0;
    HANDLE process = nullptr;
    HANDLE wait = nullptr;
  };
  static void CALLBACK OnSignalled(void* context, BOOLEAN timed_out);
  // Unregisters `w`'s wait (waiting out a running callback) and closes it.
  static void Release(std::unique_ptr<Watched> w);
  void Post(uint64_t key, uint64_t generation);
  void Loop();

  std::function<void(uint64_t)> on_exit;
  HANDLE wake = nullptr;  // auto-reset event: an exit was queued, or stop
  std::mutex mu;
  std::map<uint64_t, std::unique_ptr<Watched>> watches;  // Guarded by mu.
  std::deque<std::pair<uint64_t, uint64_t>> exits;       // (key, generation). Guarded by mu.
  uint64_t next_generation = 1;                          // Guarded by mu.
  bool stop = false;                                     // Guarded by mu.
  std::thread thread;
};

void CALLBACK ProcessWatcher::Impl::OnSignalled(void* context, BOOLEAN /*timed_out*/) {
  auto* w = static_cast<Watched*>(context);
  w->impl->Post(w->key, w->generation);
}

void ProcessWatcher::Impl::Release(std::unique_ptr<Watched> w) {
  if (w == nullptr) return;
  UnregisterWaitEx(w->wait, INVALID_HANDLE_VALUE);
  CloseHandle(w->process);
}

void ProcessWatcher::Impl::Post(uint64_t key, uint64_t generation) {
  {
    std::lock_guard<std::mutex> lock(mu);
    exits.emplace_back(key, generation);
  }
  SetEvent(wake);
}

ProcessWatcher::ProcessWatcher(std::function<void(uint64_t)> on_exit) : impl_(new Impl) {
  impl_->on_exit = std::move(on_exit);
  impl_->wake = CreateEventW(nullptr, FALSE, FALSE, nullptr);
  impl_->thread = std::thread([impl = impl_.get()] { impl->Loop(); });
}

ProcessWatcher::~ProcessWatcher() {
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->stop = true;
  }
  SetEvent(impl_->wake);
  impl_->thread.join();
  std::map<uint64_t, std::unique_ptr<Impl::Watched>> left;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    left.swap(impl_->watches);
  }
  for (auto& [key, w] : left) Impl::Release(std::move(w));
  CloseHandle(impl_->wake);
}

bool ProcessWatcher::Watch(uint64_t key, int64_t pid) {
  if (pid <= 0 || pid > static_cast<int64_t>(MAXDWORD)) {
    SetLastError(ERROR_INVALID_PARAMETER);
    return false;
  }
  HANDLE process = OpenProcess(SYNCHRONIZE, FALSE, static_cast<DWORD>(pid));
  if (process == nullptr) return false;
  auto w = std::make_unique<Impl::Watched>();
  w->impl = impl_.get();
  w->key = key;
  w->process = process;
  Impl::Watched* raw = w.get();
  std::unique_ptr<Impl::Watched> replaced;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    w->generation = impl_->next_generation++;
    // Registered under mu, so the callback (which takes mu) cannot queue this
    // watch's exit before the watch is in the map.
    if (!RegisterWaitForSingleObject(&raw->wait, process, Impl::OnSignalled, raw, INFINITE,
                                     WT_EXECUTEONLYONCE)) {
      const DWORD error = GetLastError();
      CloseHandle(process);
      SetLastError(error);
      return false;
    }
    auto& slot = impl_->watches[key];
    replaced = std::move(slot);
    slot = std::move(w);
  }
  Impl::Release(std::move(replaced));
  return true;
}

void ProcessWatcher::Unwatch(uint64_t key) {
  std::unique_ptr<Impl::Watched> w;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    auto it = impl_->watches.find(key);
    if (it == impl_->watches.end()) return;
    w = std::move(it->second);
    impl_->watches.erase(it);
  }
  Impl::Release(std::move(w));
}

void ProcessWatcher::Impl::Loop() {
  for (;;) {
    WaitForSingleObject(wake, INFINITE);
    std::vector<std::pair<uint64_t, std::unique_ptr<Watched>>> exited;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (stop) return;
      for (const auto& [key, generation] : exits) {
        auto it = watches.find(key);
        if (it == watches.end() || it->second->generation != generation) continue;
        exited.emplace_back(key, std::move(it->second));
        watches.erase(it);
      }
      exits.clear();
    }
    for (auto& [key, w] : exited) {
      Release(std::move(w));
      on_exit(key);
    }
  }
}

uint64_t ProcessStartTime(int64_t pid) {
  if (pid <= 0 || pid > 0xffffffffll) return 0;
  HANDLE process =
      OpenProcess(PROCESS_QUERY_LIMITED_INFORMATION | SYNCHRONIZE, FALSE, static_cast<DWORD>(pid));
  if (process == nullptr) return 0;
  DWORD code = 0;
  FILETIME created{}, exited{}, kernel{}, user{};
  uint64_t start = 0;
  if (GetExitCodeProcess(process, &code) && code == STILL_ACTIVE &&
      WaitForSingleObject(process, 0) == WAIT_TIMEOUT &&
      GetProcessTimes(process, &created, &exited, &kernel, &user)) {
    start = (static_cast<uint64_t>(created.dwHighDateTime) << 32) | created.dwLowDateTime;
  }
  CloseHandle(process);
  return start;
}

namespace {

// The user SID of `process`'s token, as bytes; empty when it cannot be read.
std::vector<char> TokenUserOf(HANDLE process) {
  std::vector<char> sid;
  HANDLE token = nullptr;
  if (!OpenProcessToken(process, TOKEN_QUERY, &token)) return sid;
  DWORD bytes = 0;
  GetTokenInformation(token, TokenUser, nullptr, 0, &bytes);
  std::vector<char> info(bytes);
  if (bytes != 0 && GetTokenInformation(token, TokenUser, info.data(), bytes, &bytes)) {
    PSID user = reinterpret_cast<TOKEN_USER*>(info.data())->User.Sid;
    const char* begin = static_cast<const char*>(user);
    sid.assign(begin, begin + GetLengthSid(user));
  }
  CloseHandle(token);
  return sid;
}

}  // namespace

int64_t SessionProcess(int64_t kernel_pid, int64_t stated_pid) {
  if (kernel_pid != 0) return kernel_pid;
  if (stated_pid <= 0 || stated_pid > 0xffffffffll) return 0;
  HANDLE process =
      OpenProcess(PROCESS_QUERY_LIMITED_INFORMATION, FALSE, static_cast<DWORD>(stated_pid));
  if (process == nullptr) return 0;
  const std::vector<char> theirs = TokenUserOf(process);
  CloseHandle(process);
  const std::vector<char> ours = TokenUserOf(GetCurrentProcess());
  return !theirs.empty() && theirs == ours ? stated_pid : 0;
}

}  // namespace trainstream::platform
