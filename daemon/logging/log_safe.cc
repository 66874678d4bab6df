#include "logging/log_safe.h"

#include <cstdint>

namespace trainstream::daemon {
namespace {

// Length of the valid, printable UTF-8 sequence starting at text[i], or 0 when
// the byte there must be escaped (control, invalid or overlong, surrogate, past
// U+10FFFF, truncated).
size_t PrintableSequence(std::string_view text, size_t i) {
  const auto byte = [&](size_t k) { return static_cast<uint8_t>(text[k]); };
  const uint8_t b0 = byte(i);
  if (b0 < 0x80) return (b0 < 0x20 || b0 == 0x7f) ? 0 : 1;
  size_t len = 0;
  uint32_t cp = 0;
  if (b0 >= 0xc2 && b0 <= 0xdf) {
    len = 2;
    cp = b0 & 0x1f;
  } else if (b0 >= 0xe0 && b0 <= 0xef) {
    len = 3;
    cp = b0 & 0x0f;
  } else if (b0 >= 0xf0 && b0 <= 0xf4) {
    len = 4;
    cp = b0 & 0x07;
  } else {
    return 0;  // a continuation byte, an overlong lead (C0, C1) or F5..FF
  }
  if (i + len > text.size()) return 0;
  for (size_t k = 1; k < len; ++k) {
    if ((byte(i + k) & 0xc0) != 0x80) return 0;
    cp = (cp << 6) | (byte(i + k) & 0x3f);
  }
  const bool overlong = (len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000);
  const bool surrogate = cp >= 0xd800 && cp <= 0xdfff;
  const bool c1 = cp >= 0x80 && cp <= 0x9f;
  if (overlong || surrogate || c1 || cp > 0x10ffff) return 0;
  return len;
}

}  // namespace

std::string LogSafe(std::string_view text, size_t max_bytes) {
  static const char kHex[] = "0123456789abcdef";
  const size_t n = text.size() < max_bytes ? text.size() : max_bytes;
  std::string out;
  out.reserve(n + 16);
  for (size_t i = 0; i < n;) {
    size_t len = text[i] == '\\' ? 0 : PrintableSequence(text.substr(0, n), i);
    if (len == 0) {
      const auto b = static_cast<uint8_t>(text[i]);
      out += "\\x";
      out += kHex[b >> 4];
      out += kHex[b & 0xf];
      ++i;
    } else {
      out.append(text.data() + i, len);
      i += len;
    }
  }
  if (n < text.size()) out += "...(+" + std::to_string(text.size() - n) + " bytes)";
  return out;
}

bool PrintableUtf8(std::string_view text) {
  for (size_t i = 0; i < text.size();) {
    const size_t len = PrintableSequence(text, i);
    if (len == 0) return false;
    i += len;
  }
  return true;
}

}  // namespace trainstream::daemon
