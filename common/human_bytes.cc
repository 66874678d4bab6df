#include "trainstream/human_bytes.h"

#include <cstdio>

namespace trainstream {

std::string HumanBytes(uint64_t bytes) {
  static const char* const kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  constexpr int kLastUnit = 6;
  if (bytes < 1024) return std::to_string(bytes) + " B";
  double v = static_cast<double>(bytes);
  int unit = 0;
  // 1023.995 of a unit prints as "1024.00": step up once more instead.
  while (v >= 1023.995 && unit < kLastUnit) {
    v /= 1024;
    ++unit;
  }
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f %s", v, kUnits[unit]);
  return buf;
}

}  // namespace trainstream
