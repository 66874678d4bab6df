// The platform seam for the control plane's channel: how a client reaches the
// daemon named by an endpoint, how each call proves who makes it, and how the
// daemon checks that proof (docs/windows.md, "The socket and peer identity on
// Windows").
//
// An endpoint is what a user names (TRAINSTREAM_SOCKET, --socket). On Linux it
// is the daemon's unix socket: gRPC connects to "unix:<path>", and the kernel
// tells the daemon who connected (SO_PEERCRED), so a call carries no secret.
// On Windows it is the endpoint file (platform/endpoint.h): gRPC connects to
// the loopback address the file holds, and every call carries the file's
// secret as metadata (Note [A secret in an owner-only file stands in for
// SO_PEERCRED]). Two sides, picked by platform/CMakeLists.txt:
// control_channel_linux.cc and control_channel_windows.cc; the metadata is
// control_channel.cc, shared.
#pragma once

#include <grpcpp/grpcpp.h>

#include <string>

#include "trainstream/platform/default_endpoint.h"

namespace trainstream::platform {

// The metadata key of the endpoint secret (lowercase: gRPC's rule for keys).
inline constexpr char kEndpointSecretKey[] = "trainstream-endpoint-secret";

// Where a client's channel goes, and what each call must carry.
struct ControlTarget {
  std::string grpc_target;  // "unix:/run/trainstream/trainstreamd.sock", "127.0.0.1:50123"
  std::string secret;       // empty where the kernel names the peer (Linux)
};

// Resolves `endpoint` into a target. Linux: "unix:" + endpoint, no secret,
// always 0. Windows: reads the endpoint file; ENOENT when there is none (no
// daemon has started with that endpoint), EINVAL with `*why` when it is not an
// endpoint file, or another errno value.
int ResolveControlTarget(const std::string& endpoint, ControlTarget* out, std::string* why);

// Puts `target`'s secret on a call. Every control call a client makes goes
// through this (a target without a secret adds nothing). Call it before the
// call starts: gRPC sends metadata with the call's first message.
void AddEndpointSecret(const ControlTarget& target, grpc::ClientContext* ctx);

// The daemon's check of a call: true when `secret` is empty (this daemon asks
// for none: Linux, where the transport checked the peer's credentials) or when
// the call carries exactly one secret equal to `secret`, compared in constant
// time (platform/random.h's ConstantTimeEquals).
bool CallCarriesEndpointSecret(const grpc::ServerContext& ctx, const std::string& secret);

// Why this process may not use `endpoint`, in words a user can act on ("" when
// nothing in the file system keeps it out). Linux: the socket's mode, owner
// and group, or the directory on the way that denies search, naming the group
// to join. Windows: the endpoint file exists and cannot be read. Makes no
// connection.
std::string DescribeEndpointAccessDenied(const std::string& endpoint);

// Why nothing usable answered at `endpoint` after a gRPC connect failed. Linux:
// one plain connect() tells a missing socket, a stale one, a full accept
// queue, or a daemon that accepts and closes at once (then *closed_at_once is
// set: a daemon does run there). Windows: a missing or unreadable endpoint
// file, or the address it names where nothing answers.
std::string DescribeEndpointUnreachable(const std::string& endpoint, bool* closed_at_once);

}  // namespace trainstream::platform
