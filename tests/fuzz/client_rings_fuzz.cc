// Fuzzes the daemon's ring ends (daemon/planes/client_rings.h) against a client that
// writes anything into the shared ring: the bytes are a script of client writes
// (head, tail, the header's capacity and record size, slot contents) between
// daemon pops and pushes. The rings live in exactly-sized heap blocks, so ASan
// reports any access outside them; the checks below abort on a broken contract:
//   - a successful pop publishes head = pops so far, whatever the client wrote;
//   - a successful push publishes tail = pushes so far;
//   - neither end ever hands out more records than the client could have made;
//   - once corrupt, an end stays corrupt.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "planes/client_rings.h"
#include "trainstream/wire/ring.h"
#include "trainstream/wire/session_control.h"

using namespace trainstream;
using daemon::RingResult;

namespace {

constexpr uint64_t kCapacity = 16;

struct Reader {
  const uint8_t* p;
  size_t n;
  bool Take(void* out, size_t k) {
    if (n < k) return false;
    std::memcpy(out, p, k);
    p += k;
    n -= k;
    return true;
  }
};

using RingMemory = std::unique_ptr<char, decltype(&std::free)>;

template <typename Record>
RingMemory MakeRing() {
  const size_t bytes = wire::RingBytes(kCapacity, sizeof(Record));  // a multiple of 64
  RingMemory mem(static_cast<char*>(std::aligned_alloc(64, bytes)), &std::free);
  wire::RingView::Initialize(mem.get(), kCapacity, sizeof(Record));
  return mem;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto cmd_mem = MakeRing<wire::CommandRecord>();
  auto cpl_mem = MakeRing<wire::CompletionRecord>();
  auto* cmd_h = reinterpret_cast<wire::RingHeader*>(cmd_mem.get());
  auto* cpl_h = reinterpret_cast<wire::RingHeader*>(cpl_mem.get());
  daemon::CommandConsumer consumer(cmd_h, kCapacity);
  daemon::CompletionProducer producer(cpl_h, kCapacity);
  uint64_t pops = 0, pushes = 0, max_tail = 0;
  bool consumer_corrupt = false, producer_corrupt = false;

  Reader in{data, size};
  uint8_t op = 0;
  while (in.Take(&op, 1)) {
    uint64_t v = 0;
    switch (op % 8) {
      case 0:  // the client moves the command ring's tail
        if (!in.Take(&v, 8)) return 0;
        cmd_h->tail.store(v);
        if (v - pops <= kCapacity && v > max_tail) max_tail = v;
        break;
      case 1:  // ... or its head (the daemon's counter)
        if (!in.Take(&v, 8)) return 0;
        cmd_h->head.store(v);
        break;
      case 2:  // ... or the geometry, which the daemon must never read back
        if (!in.Take(&v, 8)) return 0;
        cmd_h->capacity = v;
        cpl_h->capacity = v;
        cmd_h->record_size = static_cast<uint32_t>(v);
        cpl_h->record_size = static_cast<uint32_t>(v >> 32);
        break;
      case 3: {  // ... or slot contents
        uint8_t slot = 0;
        if (!in.Take(&slot, 1)) return 0;
        char* rec = cmd_mem.get() + sizeof(wire::RingHeader) +
                    (slot % kCapacity) * sizeof(wire::CommandRecord);
        in.Take(rec, sizeof(wire::CommandRecord) < in.n ? sizeof(wire::CommandRecord) : in.n);
        break;
      }
      case 4:  // the completion ring's head (the client's counter) or tail (ours)
        if (!in.Take(&v, 8)) return 0;
        (v & 1 ? cpl_h->head : cpl_h->tail).store(v >> 1);
        break;
      case 5: {  // the daemon pops
        wire::CommandRecord rec{};
        const RingResult r = consumer.TryPop(&rec);
        if (consumer_corrupt && r != RingResult::kCorrupt) abort();
        if (r == RingResult::kCorrupt) consumer_corrupt = true;
        if (r == RingResult::kOk) {
          ++pops;
          if (cmd_h->head.load() != pops) abort();
        }
        break;
      }
      case 6:
      case 7: {  // the daemon pushes
        wire::CompletionRecord rec{};
        rec.seq = pushes;
        const RingResult r = producer.TryPush(rec);
        if (producer_corrupt && r != RingResult::kCorrupt) abort();
        if (r == RingResult::kCorrupt) producer_corrupt = true;
        if (r == RingResult::kOk) {
          ++pushes;
          if (cpl_h->tail.load() != pushes) abort();
        }
        break;
      }
    }
  }
  (void)max_tail;
  return 0;
}
