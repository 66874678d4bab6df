// The Windows side of the stop seam (trainstream/platform/stop_signals.h).
//
// Note [Console Ctrl events on Windows]: the console Ctrl handler runs on a
// thread the system starts for each event, and may run while the receiver is
// being destroyed. So what it touches (the queue and two events) is one static
// Receiver that is never freed, and it only queues the request and sets the
// event (Note [No code in signal handlers]). The events map as follows:
//   CTRL_C_EVENT         kInterrupt, as SIGINT
//   CTRL_BREAK_EVENT     kTerminate (GenerateConsoleCtrlEvent's way to stop a
//                        process group, as kill sends SIGTERM)
//   CTRL_CLOSE_EVENT     kTerminate. The system ends the process once the
//                        handler returns (5 s at most), so the handler waits
//                        for the receiver to be destroyed (the shutdown done)
//                        for up to 4.5 s before it returns
//   CTRL_SHUTDOWN_EVENT  kShutdown, the same wait (only services receive it)
//   CTRL_LOGOFF_EVENT    not handled: only services receive it, for any user's
//                        logoff, which must not stop the daemon
#include <windows.h>

#include <cerrno>
#include <deque>
#include <mutex>
#include <utility>

#include "trainstream/platform/stop_signals.h"

namespace trainstream::platform {
namespace {

constexpr DWORD kCloseWaitMs = 4500;  // under the system's 5 s for CTRL_CLOSE_EVENT

struct Receiver {
  std::mutex mu;
  bool exists = false;               // a StopSignals is alive. Guarded by mu.
  std::deque<StopRequest> requests;  // Guarded by mu.
  HANDLE ready = nullptr;            // auto-reset: a request was queued, or Wake()
  HANDLE destroyed = nullptr;        // manual-reset: ~StopSignals ran
};

// Never freed (Note [Console Ctrl events on Windows]).
Receiver& TheReceiver() {
  static Receiver* receiver = new Receiver;
  return *receiver;
}

void Queue(StopRequest request) {
  Receiver& r = TheReceiver();
  {
    std::lock_guard<std::mutex> lock(r.mu);
    if (!r.exists) return;
    r.requests.push_back(std::move(request));
  }
  SetEvent(r.ready);
}

BOOL WINAPI OnConsoleCtrl(DWORD event) {
  StopRequest request;
  bool wait_for_shutdown = false;
  switch (event) {
    case CTRL_C_EVENT:
      request = {StopKind::kInterrupt, "Ctrl-C"};
      break;
    case CTRL_BREAK_EVENT:
      request = {StopKind::kTerminate, "Ctrl-Break"};
      break;
    case CTRL_CLOSE_EVENT:
      request = {StopKind::kTerminate, "the console closing"};
      wait_for_shutdown = true;
      break;
    case CTRL_SHUTDOWN_EVENT:
      request = {StopKind::kShutdown, "system shutdown"};
      wait_for_shutdown = true;
      break;
    default:
      return FALSE;  // CTRL_LOGOFF_EVENT: not ours to handle
  }
  Queue(std::move(request));
  if (wait_for_shutdown) WaitForSingleObject(TheReceiver().destroyed, kCloseWaitMs);
  return TRUE;
}

}  // namespace

struct StopSignals::Impl {};

int StopSignals::Create(std::unique_ptr<StopSignals>* out) {
  Receiver& r = TheReceiver();
  std::lock_guard<std::mutex> lock(r.mu);
  if (r.exists) return EBUSY;
  if (r.ready == nullptr) {
    r.ready = CreateEventW(nullptr, FALSE, FALSE, nullptr);
    r.destroyed = CreateEventW(nullptr, TRUE, FALSE, nullptr);
    if (r.ready == nullptr || r.destroyed == nullptr) return static_cast<int>(GetLastError());
  }
  // A process without a console (a service) has no Ctrl events, and the call
  // still succeeds there: the handler is simply never called.
  if (!SetConsoleCtrlHandler(OnConsoleCtrl, TRUE)) return static_cast<int>(GetLastError());
  ResetEvent(r.destroyed);
  ResetEvent(r.ready);
  r.requests.clear();
  r.exists = true;
  out->reset(new StopSignals(std::make_unique<Impl>()));
  return 0;
}

StopSignals::StopSignals(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

StopSignals::~StopSignals() {
  SetConsoleCtrlHandler(OnConsoleCtrl, FALSE);
  Receiver& r = TheReceiver();
  {
    std::lock_guard<std::mutex> lock(r.mu);
    r.exists = false;
    r.requests.clear();
  }
  SetEvent(r.destroyed);
}

StopRequest StopSignals::Wait(int timeout_ms) {
  Receiver& r = TheReceiver();
  StopRequest request;
  {
    std::lock_guard<std::mutex> lock(r.mu);
    if (!r.requests.empty()) {
      request = std::move(r.requests.front());
      r.requests.pop_front();
      return request;
    }
  }
  WaitForSingleObject(r.ready, timeout_ms < 0 ? INFINITE : static_cast<DWORD>(timeout_ms));
  std::lock_guard<std::mutex> lock(r.mu);
  if (!r.requests.empty()) {
    request = std::move(r.requests.front());
    r.requests.pop_front();
  }
  return request;
}

void StopSignals::Wake() { SetEvent(TheReceiver().ready); }

void StopSignals::Deliver(StopRequest request) { Queue(std::move(request)); }

}  // namespace trainstream::platform
