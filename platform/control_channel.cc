// The endpoint secret as gRPC metadata (trainstream/platform/control_channel.h),
// the same on every system.
#include "trainstream/platform/control_channel.h"

#include <string>

#include "trainstream/platform/random.h"

namespace trainstream::platform {

void AddEndpointSecret(const ControlTarget& target, grpc::ClientContext* ctx) {
  if (!target.secret.empty()) ctx->AddMetadata(kEndpointSecretKey, target.secret);
}

bool CallCarriesEndpointSecret(const grpc::ServerContext& ctx, const std::string& secret) {
  if (secret.empty()) return true;
  const auto& metadata = ctx.client_metadata();
  // Exactly one: a call that repeats the key is refused rather than judged by
  // whichever copy comes first.
  if (metadata.count(kEndpointSecretKey) != 1) return false;
  const grpc::string_ref sent = metadata.find(kEndpointSecretKey)->second;
  return ConstantTimeEquals(std::string(sent.data(), sent.size()), secret);
}

}  // namespace trainstream::platform
