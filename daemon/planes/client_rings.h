// The daemon's ends of a session's two rings (trainstream/wire/ring.h). The
// client maps the same pages read-write, so everything in them is hostile input.
//
// Note [Rings a client can write]. A RingView trusts the shared header: it
// re-reads the counter it owns and believes any distance between head and tail.
// A client that moves them can make the daemon replay stale records forever
// (tail = head + 2^40) or never see room on its completion ring (head > tail),
// and a client that rewrites the control header's ring offsets can aim the
// daemon's writes anywhere. So the daemon's endpoints:
//   - take the ring's place and geometry from daemon memory (ControlRings, filled
//     in when the daemon laid the region out; never read back from the header);
//   - keep their own counter (the consumer's head, the producer's tail) in daemon
//     memory, and only publish it; the peer's counter is the one thing read;
//   - check the distance on every access: 0 <= tail - head <= capacity, else the
//     ring is corrupt, the call reports kCorrupt with a message, and the caller
//     ends the session (SessionFaultFn). A corrupt ring is never touched again.
// The futex word and the sleeper count stay shared: a client that scribbles on
// them can at worst cost itself a wakeup, since every wait is bounded.
#pragma once

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <string>

#include "trainstream/platform/shared_word.h"
#include "trainstream/status.h"
#include "trainstream/wire/ring.h"
#include "trainstream/wire/session_control.h"

namespace trainstream::daemon {

// Ends a session from any thread without blocking: the data plane's way to say
// that a client broke the rules (the session layer ends it on its own thread).
using SessionFaultFn = std::function<void(uint64_t session_id, const std::string& why)>;

// Where a session's rings live, as the daemon laid them out at attach.
struct ControlRings {
  char* control = nullptr;  // the daemon's mapping of the control region
  uint64_t command_offset = 0;
  uint64_t completion_offset = 0;
  uint64_t capacity = 0;  // records per ring, a power of two

  wire::SessionControlHeader* header() const {
    return reinterpret_cast<wire::SessionControlHeader*>(control);
  }
  wire::RingHeader* command_ring() const {
    return reinterpret_cast<wire::RingHeader*>(control + command_offset);
  }
  wire::RingHeader* completion_ring() const {
    return reinterpret_cast<wire::RingHeader*>(control + completion_offset);
  }
};

enum class RingResult { kOk, kEmpty, kFull, kCorrupt };

inline void WakeRing(wire::RingHeader* h) {
  h->wake_seq.fetch_add(1, std::memory_order_release);
  platform::SharedWordWake(&h->wake_seq);
}

// The consumer of a ring the client produces (the command ring).
template <typename Record>
class ClientRingConsumer {
 public:
  ClientRingConsumer() = default;
  ClientRingConsumer(wire::RingHeader* header, uint64_t capacity)
      : header_(header), capacity_(capacity) {}

  // kOk (one record copied to *out), kEmpty or kCorrupt (see error()).
  RingResult TryPop(Record* out) {
    if (!error_.empty()) return RingResult::kCorrupt;
    const uint64_t tail = header_->tail.load(std::memory_order_acquire);
    const uint64_t pending = tail - head_;
    if (pending == 0) return RingResult::kEmpty;
    if (pending > capacity_) {
      error_ = "command ring corrupt: tail " + std::to_string(tail) + " is not within " +
               std::to_string(capacity_) + " records after head " + std::to_string(head_);
      return RingResult::kCorrupt;
    }
    std::memcpy(static_cast<void*>(out), Slot(head_), sizeof(Record));
    ++head_;
    header_->head.store(head_, std::memory_order_release);
    return RingResult::kOk;
  }

  // As TryPop, but waits up to `timeout_ns` for a record (spinning briefly
  // first: a command should cross in well under 10 us).
  RingResult Pop(Record* out, int64_t timeout_ns) {
    for (int spin = 0; spin < 2000; ++spin) {
      RingResult r = TryPop(out);
      if (r != RingResult::kEmpty) return r;
    }
    header_->sleepers.fetch_add(1, std::memory_order_seq_cst);
    const uint32_t seen = header_->wake_seq.load(std::memory_order_acquire);
    RingResult r = TryPop(out);
    if (r == RingResult::kEmpty) {
      platform::SharedWordWait(&header_->wake_seq, seen, timeout_ns);
      r = TryPop(out);
    }
    header_->sleepers.fetch_sub(1, std::memory_order_seq_cst);
    return r;
  }

  // Sleeps until the client posts (it wakes sleepers on every push), the ring
  // is woken (Wake), or `timeout_ns` passes. Pops nothing: the caller then
  // looks at this ring and its others (Note [How the plane waits],
  // optimizer_plane.cc).
  void Wait(int64_t timeout_ns) {
    if (!error_.empty()) return;
    header_->sleepers.fetch_add(1, std::memory_order_seq_cst);
    const uint32_t seen = header_->wake_seq.load(std::memory_order_acquire);
    if (header_->tail.load(std::memory_order_acquire) == head_)
      platform::SharedWordWait(&header_->wake_seq, seen, timeout_ns);
    header_->sleepers.fetch_sub(1, std::memory_order_seq_cst);
  }

  void Wake() { WakeRing(header_); }
  const std::string& error() const { return error_; }

  // For WaitForAnyRecord: whether a record (or a corrupt tail) waits, and the
  // shared header whose futex word the client wakes.
  bool HasRecord() const { return header_->tail.load(std::memory_order_acquire) != head_; }
  wire::RingHeader* header() const { return header_; }

 private:
  const void* Slot(uint64_t counter) const {
    return reinterpret_cast<const char*>(header_ + 1) +
           (counter & (capacity_ - 1)) * sizeof(Record);
  }

  wire::RingHeader* header_ = nullptr;
  uint64_t capacity_ = 0;
  uint64_t head_ = 0;  // ours: the shared copy is only written
  std::string error_;
};

// The producer of a ring the client consumes (the completion ring).
template <typename Record>
class ClientRingProducer {
 public:
  ClientRingProducer() = default;
  ClientRingProducer(wire::RingHeader* header, uint64_t capacity)
      : header_(header), capacity_(capacity) {}

  // kOk, kFull or kCorrupt (see error()).
  RingResult TryPush(const Record& rec) {
    if (!error_.empty()) return RingResult::kCorrupt;
    const uint64_t head = header_->head.load(std::memory_order_acquire);
    const uint64_t used = tail_ - head;
    if (used > capacity_) {
      error_ = "completion ring corrupt: head " + std::to_string(head) + " is not within " +
               std::to_string(capacity_) + " records before tail " + std::to_string(tail_);
      return RingResult::kCorrupt;
    }
    if (used == capacity_) return RingResult::kFull;
    std::memcpy(Slot(tail_), static_cast<const void*>(&rec), sizeof(Record));
    ++tail_;
    header_->tail.store(tail_, std::memory_order_release);
    header_->wake_seq.fetch_add(1, std::memory_order_release);
    if (header_->sleepers.load(std::memory_order_seq_cst) != 0)
      platform::SharedWordWake(&header_->wake_seq);
    return RingResult::kOk;
  }

  const std::string& error() const { return error_; }

 private:
  void* Slot(uint64_t counter) const {
    return reinterpret_cast<char*>(header_ + 1) + (counter & (capacity_ - 1)) * sizeof(Record);
  }

  wire::RingHeader* header_ = nullptr;
  uint64_t capacity_ = 0;
  uint64_t tail_ = 0;  // ours: the shared copy is only written
  std::string error_;
};

// Sleeps until the client posts on any of `rings` (it wakes sleepers on every
// push), one of them is woken (Wake), or `timeout_ns` passes; pops nothing
// (Note [How the plane waits], optimizer_plane.cc). Returns false, at once,
// where futex_waitv cannot be used (before Linux 5.16, or refused by a seccomp
// filter; known after the first call) or n is 0 or above kMaxWaitRings: the
// caller then waits on one ring at a time. Rings that reported kCorrupt must
// not be passed.
inline constexpr size_t kMaxWaitRings = platform::kMaxSharedWords;
template <typename Record>
bool WaitForAnyRecord(ClientRingConsumer<Record>* const* rings, size_t n, int64_t timeout_ns) {
  static std::atomic<bool> unsupported{false};
  if (n == 0 || n > kMaxWaitRings || unsupported.load(std::memory_order_relaxed)) return false;
  std::atomic<uint32_t>* words[kMaxWaitRings];
  uint32_t seen[kMaxWaitRings];
  bool ready = false;
  for (size_t i = 0; i < n; ++i) {
    wire::RingHeader* h = rings[i]->header();
    h->sleepers.fetch_add(1, std::memory_order_seq_cst);
    words[i] = &h->wake_seq;
    seen[i] = h->wake_seq.load(std::memory_order_acquire);
  }
  for (size_t i = 0; i < n && !ready; ++i) ready = rings[i]->HasRecord();
  if (!ready) {
    // Anything but a wake, a timeout, a changed word or a signal means the
    // system cannot wait on several words (platform/shared_word.h): never
    // retry, or the plane would spin.
    const int rc = platform::SharedWordWaitAny(words, seen, n, timeout_ns);
    if (rc != 0 && rc != ETIMEDOUT && rc != EAGAIN && rc != EINTR) {
      unsupported.store(true, std::memory_order_relaxed);
    }
  }
  for (size_t i = 0; i < n; ++i)
    rings[i]->header()->sleepers.fetch_sub(1, std::memory_order_seq_cst);
  return !unsupported.load(std::memory_order_relaxed);
}

using CommandConsumer = ClientRingConsumer<wire::CommandRecord>;
using CompletionProducer = ClientRingProducer<wire::CompletionRecord>;

// Most completions one session may have waiting in daemon memory for room on
// its ring (Note [Completions never block a worker]): 8 MiB. A client that
// stops draining its ring past this is ended, not buffered for.
inline constexpr size_t kMaxQueuedCompletions = size_t{1} << 16;

// One session's completion ring with the bounded queue behind it (Note
// [Completions never block a worker], optimizer_plane.cc): a completion goes
// to the ring when nothing waits before it, else to the queue, which Flush()
// moves into the ring as the client drains it. Not thread-safe: the plane holds
// its completion mutex around every call.
class CompletionQueue {
 public:
  CompletionQueue(wire::RingHeader* ring, uint64_t capacity) : ring_(ring, capacity) {}

  // Delivers or queues `rec`. Returns OK, or how the client broke the rules:
  // INVALID_ARGUMENT for a corrupt ring, RESOURCE_EXHAUSTED for more than
  // kMaxQueuedCompletions undrained; the caller then ends the session and calls
  // nothing here again.
  Status Push(const wire::CompletionRecord& rec) {
    if (queued_.empty()) {
      const RingResult r = ring_.TryPush(rec);
      if (r == RingResult::kOk) return Status::Ok();
      if (r == RingResult::kCorrupt) return Status(StatusCode::kInvalidArgument, ring_.error());
    }
    if (queued_.size() >= kMaxQueuedCompletions) {
      return Status(StatusCode::kResourceExhausted,
                    "the client left " + std::to_string(queued_.size()) +
                        " completions undrained (at most " + std::to_string(kMaxQueuedCompletions) +
                        " wait in the daemon)");
    }
    queued_.push_back(rec);
    return Status::Ok();
  }

  // Moves queued completions into the ring while it has room. OK, or a corrupt
  // ring's INVALID_ARGUMENT.
  Status Flush() {
    while (!queued_.empty()) {
      const RingResult r = ring_.TryPush(queued_.front());
      if (r == RingResult::kCorrupt) return Status(StatusCode::kInvalidArgument, ring_.error());
      if (r != RingResult::kOk) break;
      queued_.pop_front();
    }
    return Status::Ok();
  }

  // Drops what waits (a faulted session's completions go nowhere).
  void Clear() { queued_.clear(); }

  // Whether completions wait for room on the ring.
  bool backlogged() const { return !queued_.empty(); }

 private:
  CompletionProducer ring_;
  std::deque<wire::CompletionRecord> queued_;
};

}  // namespace trainstream::daemon
