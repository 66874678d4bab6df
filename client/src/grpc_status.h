// Conversion of gRPC statuses into the client library's Status (internal).
#pragma once

#include <grpcpp/support/status.h>

#include "trainstream/status.h"

namespace trainstream::internal {

// Maps a gRPC status; `what` prefixes transport failures (e.g. "Ping").
Status FromGrpc(const grpc::Status& s, const std::string& socket_path);

}  // namespace trainstream::internal
