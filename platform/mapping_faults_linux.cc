// The Linux side of trainstream/platform/mapping_faults.h: a SIGBUS handler
// (the daemon's ClientMemoryGuard's code, moved here), mmap MAP_FIXED over a
// faulted mapping, and eventfd wake-ups waited on with poll.
#include <poll.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <mutex>
#include <string>

#include "trainstream/platform/mapping_faults.h"
#include "trainstream/platform/sys_call.h"

namespace trainstream::platform {
namespace {

std::atomic<MappingFaultHandler> g_handler{nullptr};
struct sigaction g_previous {};
std::once_flag g_install_once;
int g_install_error = 0;
std::string g_install_message;

void OnSigbus(int sig, siginfo_t* info, void* ucontext) {
  const MappingFaultHandler handler = g_handler.load(std::memory_order_acquire);
  const int saved_errno = errno;
  const bool repaired = handler != nullptr && handler(reinterpret_cast<uintptr_t>(info->si_addr));
  errno = saved_errno;
  if (repaired) return;
  // Not client memory: a daemon bug. Hand it to whoever handled SIGBUS before,
  // or die of it (the access re-faults with the default action restored).
  if ((g_previous.sa_flags & SA_SIGINFO) != 0 && g_previous.sa_sigaction != nullptr) {
    g_previous.sa_sigaction(sig, info, ucontext);
    return;
  }
  if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN &&
      g_previous.sa_handler != nullptr) {
    g_previous.sa_handler(sig);
    return;
  }
  signal(SIGBUS, SIG_DFL);
}

}  // namespace

int InstallMappingFaultHandler(MappingFaultHandler handler, std::string* error) {
  std::call_once(g_install_once, [handler] {
    g_handler.store(handler, std::memory_order_release);
    struct sigaction sa {};
    sa.sa_sigaction = OnSigbus;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGBUS, &sa, &g_previous) != 0) {
      g_install_error = errno;
      g_install_message = ErrnoText("sigaction(SIGBUS)", g_install_error);
    }
  });
  if (g_install_error != 0) *error = g_install_message;
  return g_install_error;
}

bool ReplaceWithZeroPages(uintptr_t begin, size_t bytes) {
  void* p = mmap(reinterpret_cast<void*>(begin), bytes, PROT_READ | PROT_WRITE,
                 MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  return p != MAP_FAILED;
}

struct WakeEvent::Impl {
  int fd = -1;  // eventfd, non-blocking
};

WakeEvent::WakeEvent() : impl_(std::make_unique<Impl>()) {}

WakeEvent::~WakeEvent() {
  if (impl_->fd >= 0) close(impl_->fd);
}

int WakeEvent::Create(std::unique_ptr<WakeEvent>* out) {
  std::unique_ptr<WakeEvent> event(new WakeEvent());
  event->impl_->fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (event->impl_->fd < 0) return errno;
  *out = std::move(event);
  return 0;
}

void WakeEvent::Set() {
  const uint64_t one = 1;
  ssize_t ignored = write(impl_->fd, &one, sizeof(one));
  (void)ignored;
}

void WakeEvent::Clear() {
  uint64_t value;
  ssize_t ignored = read(impl_->fd, &value, sizeof(value));
  (void)ignored;
}

int WakeEvent::WaitEither(WakeEvent* a, WakeEvent* b) {
  pollfd fds[2] = {{a->impl_->fd, POLLIN, 0}, {b != nullptr ? b->impl_->fd : -1, POLLIN, 0}};
  for (;;) {
    if (poll(fds, b != nullptr ? 2 : 1, -1) >= 0) return 0;
    if (errno != EINTR) return errno;
  }
}

}  // namespace trainstream::platform
