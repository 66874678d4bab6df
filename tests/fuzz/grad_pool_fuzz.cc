// GradientPool (daemon/planes/grad_pool.h) against a client that names any
// extent: each 18-byte record of the input is one GRAD_READY (param, position,
// length) or a release. Aborts when an accepted extent leaves the pool or
// overlaps one still in flight (Note [A pool extent a client names]).
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "planes/grad_pool.h"

namespace {

constexpr uint64_t kCap = 1 << 16;

struct Live {
  uint64_t id, offset, len;
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace wire = trainstream::wire;
  static std::vector<char> staging(wire::kGradPoolOffset + kCap);
  trainstream::daemon::GradientPool pool(staging.data(), wire::kGradPoolOffset, kCap, true);
  std::vector<Live> live;
  for (size_t at = 0; at + 18 <= size; at += 18) {
    const uint8_t op = data[at];
    const uint64_t id = data[at + 1] % 16;
    uint64_t pos, len;
    std::memcpy(&pos, data + at + 2, 8);
    std::memcpy(&len, data + at + 10, 8);
    if (op % 4 == 0) {
      pool.Release(id);
      for (size_t i = 0; i < live.size(); ++i) {
        if (live[i].id == id) {
          live.erase(live.begin() + static_cast<long>(i));
          break;
        }
      }
      continue;
    }
    if (op % 4 == 1) pos = pool.released() + (pos % (4 * kCap));  // near the window
    if (op % 4 == 2) len %= kCap + 128;
    trainstream::optimizer::GradRef ref;
    if (!pool.Accept(id, pos, len, len, &ref).ok()) continue;
    const uint64_t off = ref.record_offset - wire::kGradPoolOffset;
    if (ref.data != staging.data() + ref.record_offset || off + len > kCap) abort();
    for (const Live& l : live) {
      if (l.id == id || !(l.offset + l.len <= off || off + len <= l.offset)) abort();
    }
    live.push_back({id, off, len});
  }
  if (pool.in_flight() != live.size()) abort();
  return 0;
}
