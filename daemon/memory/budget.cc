#include "memory/budget.h"

#include <cassert>
#include <cstdint>

#include "trainstream/human_bytes.h"

namespace trainstream::daemon {

Status Budget::Reserve(uint64_t bytes, const std::string& what) {
  uint64_t missing = 0;
  Status st = TryReserve(bytes, what, &missing);
  if (st.ok() || !reclaimer_ || bytes > limit_ || reclaimer_(missing) == 0) return st;
  return TryReserve(bytes, what, &missing);
}

Status Budget::TryReserve(uint64_t bytes, const std::string& what, uint64_t* missing) {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t available = limit_ - used_;
  if (bytes > available) {
    *missing = bytes - available;
    return Status(StatusCode::kResourceExhausted,
                  "memory budget exhausted: asked " + std::to_string(bytes) + " bytes (" +
                      HumanBytes(bytes) + ") for " + what + ", " + std::to_string(available) +
                      " bytes (" + HumanBytes(available) + ") free of the " +
                      std::to_string(limit_) + "-byte (" + HumanBytes(limit_) +
                      ") limit; free regions, end other sessions, or raise the daemon's --budget");
  }
  used_ += bytes;
  return Status::Ok();
}

void Budget::Release(uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  assert(bytes <= used_ && "released more than reserved");
  used_ = bytes > used_ ? 0 : used_ - bytes;
}

uint64_t Budget::used() const {
  std::lock_guard<std::mutex> lock(mu_);
  return used_;
}

uint64_t Budget::free() const {
  std::lock_guard<std::mutex> lock(mu_);
  return limit_ - used_;
}

}  // namespace trainstream::daemon
