// What the secrets seam does alike on every system
// (trainstream/platform/random.h).
#include "trainstream/platform/random.h"

#include <string>
#include <utility>
#include <vector>

namespace trainstream::platform {

int RandomHex(size_t bytes, std::string* out) {
  std::vector<unsigned char> raw(bytes);
  if (int err = RandomBytes(raw.data(), bytes)) return err;
  static const char kHex[] = "0123456789abcdef";
  std::string hex(bytes * 2, '0');
  for (size_t i = 0; i < bytes; ++i) {
    hex[2 * i] = kHex[raw[i] >> 4];
    hex[2 * i + 1] = kHex[raw[i] & 15];
  }
  *out = std::move(hex);
  return 0;
}

bool ConstantTimeEquals(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

}  // namespace trainstream::platform
