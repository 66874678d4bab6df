// The Linux side of the stop seam (trainstream/platform/stop_signals.h): the
// signalfd and the wake eventfd the daemon's main loop polled before the seam,
// moved here as they were (Note [No code in signal handlers]).
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <deque>
#include <mutex>
#include <utility>

#include "trainstream/platform/stop_signals.h"

namespace trainstream::platform {
namespace {

std::atomic<bool> g_exists{false};  // Create() made one that is not destroyed yet

StopKind KindOf(uint32_t signo) {
  switch (signo) {
    case SIGTERM:
      return StopKind::kTerminate;
    case SIGINT:
      return StopKind::kInterrupt;
    case SIGHUP:
      return StopKind::kReload;
    case SIGUSR2:
      return StopKind::kRestart;
    default:
      return StopKind::kNone;
  }
}

}  // namespace

struct StopSignals::Impl {
  int signal_fd = -1;
  int wake_fd = -1;  // eventfd: Wake() or Deliver()
  std::mutex mu;
  std::deque<StopRequest> delivered;  // Guarded by mu.

  // The oldest delivered request, if any.
  bool TakeDelivered(StopRequest* out) {
    std::lock_guard<std::mutex> lock(mu);
    if (delivered.empty()) return false;
    *out = std::move(delivered.front());
    delivered.pop_front();
    return true;
  }
};

int StopSignals::Create(std::unique_ptr<StopSignals>* out) {
  if (g_exists.exchange(true)) return EBUSY;
  auto impl = std::make_unique<Impl>();
  sigset_t mask;
  sigemptyset(&mask);
  sigaddset(&mask, SIGTERM);
  sigaddset(&mask, SIGINT);
  sigaddset(&mask, SIGHUP);
  sigaddset(&mask, SIGUSR2);
  // pthread_sigmask returns its error rather than setting errno.
  if (int err = pthread_sigmask(SIG_BLOCK, &mask, nullptr); err != 0) {
    g_exists.store(false);
    return err;
  }
  signal(SIGPIPE, SIG_IGN);
  impl->signal_fd = signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
  impl->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (impl->signal_fd < 0 || impl->wake_fd < 0) {
    const int err = errno;
    if (impl->signal_fd >= 0) close(impl->signal_fd);
    if (impl->wake_fd >= 0) close(impl->wake_fd);
    g_exists.store(false);
    return err;
  }
  out->reset(new StopSignals(std::move(impl)));
  return 0;
}

StopSignals::StopSignals(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

StopSignals::~StopSignals() {
  close(impl_->signal_fd);
  close(impl_->wake_fd);
  g_exists.store(false);
}

StopRequest StopSignals::Wait(int timeout_ms) {
  StopRequest request;
  if (impl_->TakeDelivered(&request)) return request;
  pollfd fds[2] = {{impl_->signal_fd, POLLIN, 0}, {impl_->wake_fd, POLLIN, 0}};
  if (poll(fds, 2, timeout_ms) <= 0) return request;  // timed out, or EINTR
  if (fds[1].revents & POLLIN) {
    uint64_t v;
    ssize_t ignored = read(impl_->wake_fd, &v, sizeof(v));
    (void)ignored;
  }
  if (fds[0].revents & POLLIN) {
    signalfd_siginfo si{};
    if (read(impl_->signal_fd, &si, sizeof(si)) == sizeof(si)) {
      request.kind = KindOf(si.ssi_signo);
      request.description = std::string("signal ") + strsignal(static_cast<int>(si.ssi_signo));
      return request;
    }
  }
  impl_->TakeDelivered(&request);
  return request;
}

void StopSignals::Wake() {
  uint64_t one = 1;
  ssize_t ignored = write(impl_->wake_fd, &one, sizeof(one));
  (void)ignored;
}

void StopSignals::Deliver(StopRequest request) {
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->delivered.push_back(std::move(request));
  }
  Wake();
}

}  // namespace trainstream::platform
