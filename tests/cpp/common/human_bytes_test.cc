// HumanBytes (common/include/trainstream/human_bytes.h): the one rendering of a
// byte count, shared by the daemon's messages and trainstreamctl's tables.
#include "trainstream/human_bytes.h"

#include <cstdint>

#include "catch_compat.h"

using trainstream::HumanBytes;

TEST_CASE("HumanBytes writes counts under a KiB exactly", "[human_bytes]") {
  CHECK(HumanBytes(0) == "0 B");
  CHECK(HumanBytes(1) == "1 B");
  CHECK(HumanBytes(1023) == "1023 B");
}

TEST_CASE("HumanBytes writes larger counts in binary units with two decimals", "[human_bytes]") {
  CHECK(HumanBytes(1024) == "1.00 KiB");
  CHECK(HumanBytes(1536) == "1.50 KiB");
  CHECK(HumanBytes(3ull << 20) == "3.00 MiB");
  CHECK(HumanBytes((1ull << 30) + (1ull << 29)) == "1.50 GiB");
  CHECK(HumanBytes(5ull << 40) == "5.00 TiB");
  CHECK(HumanBytes(7ull << 50) == "7.00 PiB");
  CHECK(HumanBytes(UINT64_MAX) == "16.00 EiB");
}

TEST_CASE("HumanBytes never writes 1024.00 of a unit", "[human_bytes]") {
  CHECK(HumanBytes((1ull << 20) - 1) == "1.00 MiB");  // 1023.999 KiB
  CHECK(HumanBytes((1ull << 30) - (1ull << 20)) == "1023.00 MiB");
  CHECK(HumanBytes((1ull << 40) - 1) == "1.00 TiB");
}
