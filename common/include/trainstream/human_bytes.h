// HumanBytes: a byte count as a person reads it, the one rendering every log
// line, error message and `trainstreamctl` table uses. Binary units (a KiB is
// 1024 bytes) with two decimals, so that a budget, a segment and the free
// space beside it compare at a glance whoever wrote them: "512 B", "1.50 GiB",
// "16.00 EiB" for the largest count. A value that would round up to 1024.00
// of one unit is written as 1.00 of the next.
#pragma once

#include <cstdint>
#include <string>

namespace trainstream {

std::string HumanBytes(uint64_t bytes);

}  // namespace trainstream
