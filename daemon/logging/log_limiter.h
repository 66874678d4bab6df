// LogLimiter: caps the log lines one client can cause. A client that posts bad
// commands as fast as it can must not turn the daemon's log into its own output
// (such a client once added 580 MB of log in 10 s): the first `burst` lines
// pass, then one per `interval`, and the line that passes says how many were
// dropped before it. Thread-safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>

namespace trainstream::daemon {

class LogLimiter {
 public:
  explicit LogLimiter(uint32_t burst = 20,
                      std::chrono::steady_clock::duration interval = std::chrono::seconds(1))
      : burst_(burst), interval_(interval) {}
  LogLimiter(const LogLimiter&) = delete;
  LogLimiter& operator=(const LogLimiter&) = delete;

  // True when this line may be logged; then *suppressed holds how many lines were
  // dropped since the last one that passed.
  bool Allow(uint64_t* suppressed) {
    const auto now = std::chrono::steady_clock::now();
    std::lock_guard<std::mutex> lock(mu_);
    if (passed_ < burst_ || now - last_ >= interval_) {
      ++passed_;
      last_ = now;
      *suppressed = dropped_;
      dropped_ = 0;
      return true;
    }
    ++dropped_;
    return false;
  }

 private:
  const uint32_t burst_;
  const std::chrono::steady_clock::duration interval_;
  std::mutex mu_;
  uint32_t passed_ = 0;                         // Guarded by mu_.
  uint64_t dropped_ = 0;                        // Guarded by mu_.
  std::chrono::steady_clock::time_point last_;  // Guarded by mu_.
};

}  // namespace trainstream::daemon
