// GradientPool: the daemon's end of one registration's gradient staging pool
// (trainstream/wire/grad_pool.h, docs/staging-pool.md). The client chooses
// where each gradient goes; this class checks every extent it names against
// what the daemon holds in its own memory, hands the engine a pointer only to
// bytes no other update in flight reads, and publishes what is free again once
// an update has committed.
//
// Note [A pool extent a client names]. Everything a GRAD_READY says about its
// extent (position, length) is hostile input, and so is the pool header, which
// the daemon writes and never reads back. Accept refuses, leaving the session
// running, an extent that
//   - is not as long as the parameter's gradient (numel x grad dtype, the
//     daemon's binding), or is not kPoolAlign-aligned, or overflows 64 bits;
//   - wraps around the end of the pool;
//   - belongs to a parameter that has an extent in flight (the engine allows
//     one update per parameter);
//   - with extents in flight: starts before the end of the last accepted one
//     (the client posts in claim order; gaps are padding), or ends more than
//     one lap past `released`.
// The extents in flight lie in [released, expect), a new one in [expect,
// released + C): so no byte is ever read by two updates at once, whatever the
// client sends. With nothing in flight every byte is free and any aligned,
// non-wrapping extent is taken (after a restart the client starts where its
// replays are: Note [Resuming after the daemon died]). A client that writes the
// header or into an extent in flight only garbles its own training, as writing
// into its gradient slot did; the daemon touches only this pool's header.
//
// Thread safety: Accept and Abandon on the plane thread, Release on worker
// threads; all state is under mu_. Release never blocks (Note [Completions
// never block a worker]): a futex wake at most.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <unordered_map>

#include "trainstream/optimizer/adamw_engine.h"
#include "trainstream/status.h"
#include "trainstream/wire/grad_pool.h"

namespace trainstream::daemon {

class GradientPool {
 public:
  // The pool of a staging segment mapped at `staging` (its GradPoolHeader at
  // kGradPoolHeaderOffset, `capacity` bytes at `pool_offset`), which must
  // outlive the pool. `fresh`: a new registration's, whose header is written
  // here; else adopted after a restart, whose header the client keeps.
  GradientPool(char* staging, uint64_t pool_offset, uint64_t capacity, bool fresh);
  GradientPool(const GradientPool&) = delete;
  GradientPool& operator=(const GradientPool&) = delete;

  // Checks [pos, pos + len) for `param_id`, whose gradient is `expected_len`
  // bytes (Note [A pool extent a client names]); on success records it in
  // flight and sets `*out` to its bytes (record_offset: from the staging start).
  // INVALID_ARGUMENT names the broken rule.
  Status Accept(uint64_t param_id, uint64_t pos, uint64_t len, uint64_t expected_len,
                optimizer::GradRef* out);

  // The update of `param_id` committed (or was refused after Accept): its
  // extent is free; `released` moves over every finished extent at the front.
  // A param with nothing in flight is ignored.
  void Release(uint64_t param_id);

  uint64_t capacity() const { return capacity_; }
  uint64_t pool_offset() const { return pool_offset_; }
  // For tests: extents in flight, and the first position not yet free.
  size_t in_flight() const;
  uint64_t released() const;

 private:
  struct Extent {
    uint64_t len;
    bool done;
  };
  char* const staging_;
  wire::GradPoolHeader* const header_;  // written, never read
  const uint64_t pool_offset_;
  const uint64_t capacity_;

  mutable std::mutex mu_;
  std::map<uint64_t, Extent> in_flight_;           // Guarded by mu_: by position
  std::unordered_map<uint64_t, uint64_t> pos_of_;  // Guarded by mu_: param_id -> position
  uint64_t expect_ = 0;                            // Guarded by mu_: end of the last accepted
  uint64_t released_ = 0;                          // Guarded by mu_
};

}  // namespace trainstream::daemon
