// Budget: the machine-wide limit on shared (and pinned) memory the daemon hands
// out. Every segment reserves its full size before it is created and releases
// it when it is unmapped. Thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <mutex>
#include <string>

#include "trainstream/status.h"

namespace trainstream::daemon {

class Budget {
 public:
  explicit Budget(uint64_t limit) : limit_(limit) {}
  Budget(const Budget&) = delete;
  Budget& operator=(const Budget&) = delete;

  // Takes `bytes` from the budget, or fails with RESOURCE_EXHAUSTED naming the
  // bytes asked, the bytes free and the limit (`what` says what they were for).
  Status Reserve(uint64_t bytes, const std::string& what);
  // Returns bytes taken by Reserve. Returning more than is in use is a bug; it
  // clamps at zero (and asserts in debug builds).
  void Release(uint64_t bytes);

  // Called (without the budget's lock) when a reservation does not fit, with the
  // bytes missing; returns the bytes it released (e.g. by evicting unreferenced
  // bases). Reserve then tries once more. Set before the budget is shared.
  void SetReclaimer(std::function<uint64_t(uint64_t missing)> reclaimer) {
    reclaimer_ = std::move(reclaimer);
  }

  uint64_t limit() const { return limit_; }
  uint64_t used() const;
  uint64_t free() const;

 private:
  Status TryReserve(uint64_t bytes, const std::string& what, uint64_t* missing);
  const uint64_t limit_;
  std::function<uint64_t(uint64_t)> reclaimer_;
  mutable std::mutex mu_;
  uint64_t used_ = 0;  // Guarded by mu_.
};

}  // namespace trainstream::daemon
