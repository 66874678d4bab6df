// The Windows side of trainstream/platform/mapping_faults.h: no mapped file
// shrinks here (Note [A mapped segment cannot shrink on Windows]), so there is
// no fault to handle; wake-ups are manual-reset events.
#include <windows.h>

#include <cerrno>
#include <memory>
#include <string>

#include "trainstream/platform/mapping_faults.h"
#include "windows_common.h"

namespace trainstream::platform {

int InstallMappingFaultHandler(MappingFaultHandler, std::string*) { return 0; }

bool ReplaceWithZeroPages(uintptr_t, size_t) { return false; }

struct WakeEvent::Impl {
  HANDLE event = nullptr;  // manual reset: set until Clear
};

WakeEvent::WakeEvent() : impl_(std::make_unique<Impl>()) {}

WakeEvent::~WakeEvent() {
  if (impl_->event != nullptr) CloseHandle(impl_->event);
}

int WakeEvent::Create(std::unique_ptr<WakeEvent>* out) {
  std::unique_ptr<WakeEvent> event(new WakeEvent());
  event->impl_->event = CreateEventW(nullptr, TRUE, FALSE, nullptr);
  if (event->impl_->event == nullptr) return internal::LastErrno();
  *out = std::move(event);
  return 0;
}

void WakeEvent::Set() { SetEvent(impl_->event); }

void WakeEvent::Clear() { ResetEvent(impl_->event); }

int WakeEvent::WaitEither(WakeEvent* a, WakeEvent* b) {
  HANDLE handles[2] = {a->impl_->event, b != nullptr ? b->impl_->event : nullptr};
  const DWORD rc = WaitForMultipleObjects(b != nullptr ? 2 : 1, handles, FALSE, INFINITE);
  return rc == WAIT_FAILED ? internal::LastErrno() : 0;
}

}  // namespace trainstream::platform
