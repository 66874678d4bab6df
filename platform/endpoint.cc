// The endpoint file's format (trainstream/platform/endpoint.h), the same on
// every system; the owner-only file is endpoint_linux.cc and
// endpoint_windows.cc, the secret platform/random.h's.
#include "trainstream/platform/endpoint.h"

#include <cerrno>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <system_error>
#include <utility>

#include "endpoint_system.h"
#include "trainstream/platform/random.h"

namespace trainstream::platform {
namespace {

constexpr char kMagic[] = "trainstream-endpoint 1";

bool IsLowerHex(const std::string& s) {
  for (char c : s) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

// "host:port" with a port of 1 to 65535 and no whitespace.
bool ValidAddress(const std::string& address) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == address.size()) return false;
  if (address.find_first_of(" \t\r\n") != std::string::npos) return false;
  uint32_t port = 0;
  for (size_t i = colon + 1; i < address.size(); ++i) {
    if (address[i] < '0' || address[i] > '9' || i - colon > 5) return false;
    port = port * 10 + static_cast<uint32_t>(address[i] - '0');
  }
  return port >= 1 && port <= 65535;
}

bool ValidSecret(const std::string& secret) {
  return secret.size() == 2 * kEndpointSecretBytes && IsLowerHex(secret);
}

}  // namespace

int NewEndpointSecret(std::string* secret) { return RandomHex(kEndpointSecretBytes, secret); }

int WriteEndpointFile(const std::string& path, const Endpoint& endpoint) {
  if (!ValidAddress(endpoint.address) || !ValidSecret(endpoint.secret)) return EINVAL;
  const std::string text =
      std::string(kMagic) + "\naddress " + endpoint.address + "\nsecret " + endpoint.secret + "\n";
  return internal::ReplaceWithOwnerOnlyFile(path, text);
}

int ReadEndpointFile(const std::string& path, Endpoint* out, std::string* why) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return ec ? ec.value() : ENOENT;
  std::ifstream in(path, std::ios::binary);
  if (!in) return EACCES;  // it exists, and cannot be opened
  std::string magic, address_line, secret_line, extra;
  std::getline(in, magic);
  std::getline(in, address_line);
  std::getline(in, secret_line);
  if (in.bad()) return EIO;
  auto refuse = [&](const std::string& what) {
    *why = path + " is not a trainstream endpoint file: " + what;
    return EINVAL;
  };
  if (magic != kMagic) return refuse("its first line is not '" + std::string(kMagic) + "'");
  if (address_line.rfind("address ", 0) != 0) return refuse("no 'address' line");
  if (secret_line.rfind("secret ", 0) != 0) return refuse("no 'secret' line");
  Endpoint e{address_line.substr(8), secret_line.substr(7)};
  if (!ValidAddress(e.address)) return refuse("the address '" + e.address + "' is not host:port");
  if (!ValidSecret(e.secret)) {
    return refuse("the secret is not " + std::to_string(2 * kEndpointSecretBytes) +
                  " lowercase hex digits");
  }
  if (std::getline(in, extra) && !extra.empty()) return refuse("it has more than three lines");
  *out = std::move(e);
  return 0;
}

}  // namespace trainstream::platform
