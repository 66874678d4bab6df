// The one place where trainstream::Status meets grpc::Status (Note [One Status
// below the transport], trainstream/status.h). Part of trainstream_proto, beside
// the generated stubs: only code that already speaks gRPC can include it.
#pragma once

#include <grpcpp/support/status.h>

#include <string>

#include "trainstream/status.h"

namespace trainstream {

// The gRPC code of the same name; the daemon's ControlService answers with it.
grpc::StatusCode ToGrpcCode(StatusCode code);
// The daemon's side: `s` as the gRPC status its handlers return (same message).
grpc::Status ToGrpc(const Status& s);

namespace internal {

// The client's side: maps what the daemon (or gRPC itself) answered into the
// client library's Status. Codes the client does not tell apart fold together
// (OUT_OF_RANGE is INVALID_ARGUMENT, UNAUTHENTICATED is PERMISSION_DENIED,
// CANCELLED is UNAVAILABLE, the rest INTERNAL), and transport failures name the
// daemon's socket, `socket_path`.
Status FromGrpc(const grpc::Status& s, const std::string& socket_path);

}  // namespace internal
}  // namespace trainstream
