// libFuzzer target for the safetensors header parser (daemon/base/safetensors.h).
// Input: a whole file. The parser must return an error or a header whose every
// tensor lies inside the data area, never crash, hang or read out of bounds.
// Build and run: docs/base-cache.md, "Fuzzing".
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "base/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace trainstream::daemon::base;
  SafetensorsHeader h;
  const trainstream::Status st = ParseSafetensorsBuffer("fuzz.safetensors", data, size, &h);
  if (st.ok()) {
    // The invariants the loader relies on.
    uint64_t cursor = 0;
    for (const auto& t : h.tensors) {
      if (t.begin != cursor || t.end < t.begin) std::abort();
      if (t.bytes() != t.numel() * SafetensorsDTypeSize(t.dtype)) std::abort();
      cursor = t.end;
    }
    if (h.data_start + cursor != size) std::abort();
  }
  ShardIndex idx;
  ParseShardIndex("fuzz.index.json", std::string_view(reinterpret_cast<const char*>(data), size),
                  &idx);
  return 0;
}
