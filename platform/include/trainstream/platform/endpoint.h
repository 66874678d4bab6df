// The platform seam for finding and proving the daemon's control endpoint
// where it cannot be a unix socket: on Windows, gRPC 1.51 has no unix:
// addresses and Wine 8.0 no AF_UNIX, so the daemon serves gRPC on loopback
// TCP and writes where it listens, with a secret, to a file only its user can
// read (docs/windows.md, "The socket and peer identity on Windows").
//
// Note [A secret in an owner-only file stands in for SO_PEERCRED]. On Linux the
// kernel tells the daemon who connected. Over loopback TCP nothing does (and
// Wine reports no owning pid either), so a caller proves instead that it could
// read the endpoint file: it sends the secret with every call, and the daemon
// compares it in constant time. Whoever can read the file is the daemon's user
// (or SYSTEM and Administrators, who can read anything). The file is replaced
// at every start, so a secret lives as long as one daemon.
//
// The file is three lines, "trainstream-endpoint 1", "address <host:port>" and
// "secret <64 hex digits>". Two sides, picked by platform/CMakeLists.txt,
// for the owner-only file (mode 0600; a protected DACL that grants the
// process's user alone, as segments have: Note [Segments on Windows are files
// with an owner-only DACL]); the format is endpoint.cc, shared, and the secret
// comes from platform/random.h.
// The Linux daemon does not use it (it has SO_PEERCRED); it is built and tested
// there so both sides keep one format.
#pragma once

#include <cstddef>
#include <string>

namespace trainstream::platform {

inline constexpr size_t kEndpointSecretBytes = 32;

struct Endpoint {
  std::string address;  // "127.0.0.1:<port>", as gRPC takes it
  std::string secret;   // 2 * kEndpointSecretBytes lowercase hex digits
};

// A new secret: kEndpointSecretBytes from the system's random source, as
// lowercase hex (platform/random.h, which also compares secrets: use its
// ConstantTimeEquals). Returns 0 or an errno value.
int NewEndpointSecret(std::string* secret);

// Writes `endpoint` to `path`, readable and writable by this process's user
// alone, replacing an older file in one step (a new file, then a rename), so a
// client never reads half of one. The folder must exist. Returns 0, EINVAL for
// an address or secret the format cannot hold, or an errno value.
int WriteEndpointFile(const std::string& path, const Endpoint& endpoint);

// Reads `path`. Returns 0, ENOENT when there is none (no daemon has started),
// EINVAL when it is not an endpoint file (then `*why` says what is wrong), or
// an errno value.
int ReadEndpointFile(const std::string& path, Endpoint* out, std::string* why);

}  // namespace trainstream::platform
