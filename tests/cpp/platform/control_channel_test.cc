// The control channel's seam (trainstream/platform/control_channel.h): the
// endpoint secret a client puts on every call and the daemon's check of it,
// over a real gRPC connection on loopback TCP (where the Windows daemon
// listens; it runs the same on Linux). Each system's endpoint resolution is
// control_channel_linux_test.cc / control_channel_windows_test.cc.
#include "trainstream/platform/control_channel.h"

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <memory>
#include <string>

#include "catch_compat.h"
#include "control_channel_loopback.h"
#include "trainstream/platform/endpoint.h"
#include "trainstream/v1/control.grpc.pb.h"

namespace platform = trainstream::platform;
namespace v1 = trainstream::v1;

namespace {

// A Ping through `target`, with its secret and, when given, a second one.
grpc::StatusCode PingWith(const platform::ControlTarget& target,
                          const std::string& extra_secret = "") {
  auto stub = v1::Control::NewStub(
      grpc::CreateChannel(target.grpc_target, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  platform::AddEndpointSecret(target, &context);
  if (!extra_secret.empty()) context.AddMetadata(platform::kEndpointSecretKey, extra_secret);
  v1::PingResponse response;
  const grpc::Status s = stub->Ping(&context, v1::PingRequest(), &response);
  if (s.ok()) CHECK(response.version() == "checked");
  return s.error_code();
}

}  // namespace

TEST_CASE("a call that carries the endpoint secret is let in", "[control_channel]") {
  std::string secret;
  REQUIRE(platform::NewEndpointSecret(&secret) == 0);
  SecretCheckingServer server(secret);
  CHECK(PingWith({server.address(), secret}) == grpc::StatusCode::OK);
  CHECK(server.calls() == 1);
}

TEST_CASE("a call without the secret, or with another, is refused", "[control_channel]") {
  std::string secret, other;
  REQUIRE(platform::NewEndpointSecret(&secret) == 0);
  REQUIRE(platform::NewEndpointSecret(&other) == 0);
  REQUIRE(other != secret);
  SecretCheckingServer server(secret);
  CHECK(PingWith({server.address(), ""}) == grpc::StatusCode::PERMISSION_DENIED);
  CHECK(PingWith({server.address(), other}) == grpc::StatusCode::PERMISSION_DENIED);
  // Differs in the last digit only; a prefix; the secret with a byte more.
  std::string last = secret;
  last.back() = last.back() == '0' ? '1' : '0';
  CHECK(PingWith({server.address(), last}) == grpc::StatusCode::PERMISSION_DENIED);
  CHECK(PingWith({server.address(), secret.substr(0, 32)}) == grpc::StatusCode::PERMISSION_DENIED);
  CHECK(PingWith({server.address(), secret + "0"}) == grpc::StatusCode::PERMISSION_DENIED);
  CHECK(server.calls() == 0);
}

TEST_CASE("a call that carries the secret twice is refused", "[control_channel]") {
  std::string secret, other;
  REQUIRE(platform::NewEndpointSecret(&secret) == 0);
  REQUIRE(platform::NewEndpointSecret(&other) == 0);
  SecretCheckingServer server(secret);
  CHECK(PingWith({server.address(), secret}, other) == grpc::StatusCode::PERMISSION_DENIED);
  CHECK(PingWith({server.address(), secret}, secret) == grpc::StatusCode::PERMISSION_DENIED);
  CHECK(server.calls() == 0);
}

TEST_CASE("a daemon that asks for no secret lets every call in", "[control_channel]") {
  SecretCheckingServer server("");
  CHECK(PingWith({server.address(), ""}) == grpc::StatusCode::OK);
  CHECK(PingWith({server.address(), std::string(64, 'a')}) == grpc::StatusCode::OK);
  CHECK(server.calls() == 2);
}
