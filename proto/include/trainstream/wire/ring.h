// Single-producer/single-consumer ring of fixed-size records in shared memory,
// woken through a shared word (platform/shared_word.h: a futex on Linux; polled
// on Windows, Note [Windows polls the shared word]). No lock is ever held, so a process that
// dies mid-operation cannot wedge its peer (docs/design.md, "Rings and wakeups").
//
// Layout (all in one mapping, 64-byte aligned):
//   RingHeader            capacity, record size, head/tail counters, wake word
//   record[capacity]      the records
//
// The producer owns `tail`, the consumer owns `head`. Both are free-running
// 64-bit counters; slot = counter & (capacity - 1).
#pragma once

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>

#include "trainstream/platform/shared_word.h"

namespace trainstream::wire {

inline constexpr uint32_t kRingMagic = 0x54535247;  // "TSRG"

struct alignas(64) RingHeader {
  uint32_t magic;
  uint32_t record_size;                    // bytes per record, a multiple of 8
  uint64_t capacity;                       // records, a power of two
  alignas(64) std::atomic<uint64_t> head;  // next record to consume (consumer writes)
  alignas(64) std::atomic<uint64_t> tail;  // next record to produce (producer writes)
  // Incremented by the producer after each push; the consumer sleeps on it.
  alignas(64) std::atomic<uint32_t> wake_seq;
  // Non-zero while the consumer is (about to be) asleep: the producer only pays
  // for a wake when someone may be waiting.
  std::atomic<uint32_t> sleepers;
};
static_assert(sizeof(RingHeader) == 256, "RingHeader layout is part of the wire format");

inline size_t RingBytes(uint64_t capacity, uint32_t record_size) {
  return sizeof(RingHeader) + capacity * record_size;
}

// A view of a ring living at `base`. Cheap to copy; does not own the memory.
class RingView {
 public:
  RingView() = default;
  // Reads capacity and record size once, here: the peer can write the shared
  // header, so a view never trusts those fields again (a corrupted capacity
  // must not become an out-of-bounds access in the daemon).
  explicit RingView(void* base)
      : header_(static_cast<RingHeader*>(base)),
        capacity_(header_->capacity),
        record_size_(header_->record_size) {}

  // Writes a fresh, empty ring header at `base`. Only the segment's creator calls this.
  static RingView Initialize(void* base, uint64_t capacity, uint32_t record_size) {
    auto* h = new (base) RingHeader();
    h->magic = kRingMagic;
    h->record_size = record_size;
    h->capacity = capacity;
    h->head.store(0, std::memory_order_relaxed);
    h->tail.store(0, std::memory_order_relaxed);
    h->wake_seq.store(0, std::memory_order_relaxed);
    h->sleepers.store(0, std::memory_order_relaxed);
    return RingView(base);
  }

  bool valid() const {
    return header_ != nullptr && header_->magic == kRingMagic && capacity_ != 0 &&
           (capacity_ & (capacity_ - 1)) == 0 && record_size_ != 0 && record_size_ % 8 == 0;
  }
  RingHeader* header() const { return header_; }

  // Producer side. Returns false when the ring is full.
  bool TryPush(const void* record) {
    const uint64_t tail = header_->tail.load(std::memory_order_relaxed);
    const uint64_t head = header_->head.load(std::memory_order_acquire);
    if (tail - head >= capacity_) return false;
    std::memcpy(Slot(tail), record, record_size_);
    header_->tail.store(tail + 1, std::memory_order_release);
    header_->wake_seq.fetch_add(1, std::memory_order_release);
    if (header_->sleepers.load(std::memory_order_seq_cst) != 0)
      platform::SharedWordWake(&header_->wake_seq);
    return true;
  }

  // Consumer side. Returns false when the ring is empty.
  bool TryPop(void* record) {
    const uint64_t head = header_->head.load(std::memory_order_relaxed);
    const uint64_t tail = header_->tail.load(std::memory_order_acquire);
    if (head == tail) return false;
    std::memcpy(record, Slot(head), record_size_);
    header_->head.store(head + 1, std::memory_order_release);
    return true;
  }

  // Consumer side: blocks until a record arrives or `timeout_ns` passes (< 0:
  // forever). Returns true if a record was popped. Spins briefly first: a
  // command should cross in well under 10 us.
  bool Pop(void* record, int64_t timeout_ns) {
    for (int spin = 0; spin < 2000; ++spin) {
      if (TryPop(record)) return true;
    }
    header_->sleepers.fetch_add(1, std::memory_order_seq_cst);
    const uint32_t seen = header_->wake_seq.load(std::memory_order_acquire);
    bool got = TryPop(record);
    if (!got) {
      platform::SharedWordWait(&header_->wake_seq, seen, timeout_ns);
      got = TryPop(record);
    }
    header_->sleepers.fetch_sub(1, std::memory_order_seq_cst);
    return got;
  }

  // Wakes a consumer blocked in Pop (e.g. to make it notice shutdown).
  void WakeConsumer() {
    header_->wake_seq.fetch_add(1, std::memory_order_release);
    platform::SharedWordWake(&header_->wake_seq);
  }

  uint64_t size() const {
    return header_->tail.load(std::memory_order_acquire) -
           header_->head.load(std::memory_order_acquire);
  }

 private:
  void* Slot(uint64_t counter) const {
    return reinterpret_cast<char*>(header_ + 1) + (counter & (capacity_ - 1)) * record_size_;
  }

  RingHeader* header_ = nullptr;
  uint64_t capacity_ = 0;     // copied at construction, see the constructor
  uint32_t record_size_ = 0;  // ditto
};

}  // namespace trainstream::wire
