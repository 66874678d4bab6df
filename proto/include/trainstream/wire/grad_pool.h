// A registration's gradient staging pool: one byte ring in its staging segment
// through which every gradient of a solo session without clipping passes,
// instead of a slot per parameter (docs/staging-pool.md).
//
// Layout of a pooled staging segment:
//   [0, 4096)            SegmentHeader
//   [4096, 4352)         GradPoolHeader
//   [8192, 8192 + C)     the pool (C, its capacity, a multiple of 4096)
//   then the param slots, as without a pool.
//
// Positions are free-running 64-bit byte counters (as the rings' head and
// tail): byte `pos` lives at pool offset `pos % C`. The client alone chooses
// positions (its `claim`, in its own memory): an extent of `len` bytes starts
// at PlaceExtent(claim, len, C), never wraps, and is taken once ExtentFree says
// the daemon has released what it would overwrite. GRAD_READY then names it:
// flags = kFlagPooledGrad, region_offset = pos, bytes = len, region_id = 0.
// The daemon checks every extent against what it holds in its own memory
// (daemon/planes/grad_pool.h) and never reads this header back. Clipping and
// data-parallel groups keep one gradient slot per parameter (Note [Clipping
// keeps gradient slots], python/trainstream/optim/grad_pool.py).
#pragma once

#include <atomic>
#include <cstdint>

namespace trainstream::wire {

inline constexpr uint32_t kGradPoolMagic = 0x54534750;  // "TSGP"
inline constexpr uint32_t kGradPoolVersion = 1;
// CommandRecord::flags on kGradReady: the gradient is a pool extent.
inline constexpr uint32_t kFlagPooledGrad = 1;
inline constexpr uint64_t kPoolAlign = 64;  // extents start 64-byte aligned
inline constexpr uint64_t kGradPoolHeaderOffset = 4096;
inline constexpr uint64_t kGradPoolOffset = 8192;  // the pool's first byte in the staging

struct alignas(64) GradPoolHeader {
  uint32_t magic;     // kGradPoolMagic   (the daemon writes these once)
  uint32_t version;   // kGradPoolVersion
  uint64_t capacity;  // C
  uint64_t pool_offset;
  // Daemon: every position below this one is free (stored with release).
  alignas(64) std::atomic<uint64_t> released;
  // Daemon: incremented after each store of `released`; the client sleeps on it.
  alignas(64) std::atomic<uint32_t> release_seq;
  // Client: nonzero while it may be asleep on release_seq (the daemon then wakes it).
  std::atomic<uint32_t> waiters;
};
static_assert(sizeof(GradPoolHeader) == 192, "wire format");
static_assert(kGradPoolHeaderOffset + 256 <= kGradPoolOffset, "wire format");

// Where an extent of `len` bytes goes when the next free position is `claim`:
// at `claim`, or, when it would cross the end of the pool, at the next lap's
// start (the bytes between are padding). `len` must be at most `capacity`.
inline uint64_t PlaceExtent(uint64_t claim, uint64_t len, uint64_t capacity) {
  const uint64_t at = claim % capacity;
  return at + len <= capacity ? claim : claim - at + capacity;
}

// Whether [pos, pos + len) may be written when the daemon has released every
// position below `released` and the extents handed over end at `claim`:
// nothing in flight (every byte is free), or the extent ends within one lap of
// `released`. Overflow-safe for any 64-bit values.
inline bool ExtentFree(uint64_t pos, uint64_t len, uint64_t released, uint64_t claim,
                       uint64_t capacity) {
  if (len > capacity || pos > UINT64_MAX - len) return false;
  if (released == claim) return true;
  return released <= pos && pos + len - released <= capacity;
}

}  // namespace trainstream::wire
