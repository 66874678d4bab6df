// The Windows side of the control channel (control_channel_windows.cc): the
// endpoint is a file naming a loopback address and the secret every call
// carries (platform/endpoint.h).
#include <grpcpp/grpcpp.h>
#include <windows.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "catch_compat.h"
#include "control_channel_loopback.h"
#include "trainstream/platform/control_channel.h"
#include "trainstream/platform/endpoint.h"
#include "trainstream/platform/user.h"
#include "trainstream/v1/control.grpc.pb.h"

namespace fs = std::filesystem;
namespace platform = trainstream::platform;
namespace v1 = trainstream::v1;

namespace {

// A fresh folder under the temporary directory, removed at the end.
struct TempFolder {
  fs::path path;
  TempFolder() {
    path =
        fs::temp_directory_path() / ("ts-control-channel-" + std::to_string(GetCurrentProcessId()));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempFolder() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string file(const char* name) const { return (path / name).u8string(); }
};

}  // namespace

TEST_CASE("on Windows the endpoint file leads a client to the daemon with its secret",
          "[control_channel]") {
  TempFolder folder;
  std::string secret;
  REQUIRE(platform::NewEndpointSecret(&secret) == 0);
  SecretCheckingServer server(secret);
  const std::string file = folder.file("trainstreamd.endpoint");
  REQUIRE(platform::WriteEndpointFile(file, {server.address(), secret}) == 0);

  platform::ControlTarget target;
  std::string why;
  REQUIRE(platform::ResolveControlTarget(file, &target, &why) == 0);
  CHECK(target.grpc_target == server.address());
  CHECK(target.secret == secret);
  CHECK(platform::DescribeEndpointAccessDenied(file).empty());

  auto stub = v1::Control::NewStub(
      grpc::CreateChannel(target.grpc_target, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  platform::AddEndpointSecret(target, &context);
  v1::PingResponse response;
  CHECK(stub->Ping(&context, v1::PingRequest(), &response).ok());
  CHECK(server.calls() == 1);
}

TEST_CASE("on Windows no endpoint file is no daemon, named", "[control_channel]") {
  TempFolder folder;
  const std::string file = folder.file("missing.endpoint");
  platform::ControlTarget target;
  std::string why;
  CHECK(platform::ResolveControlTarget(file, &target, &why) == ENOENT);
  CHECK(why.find(file) != std::string::npos);
  CHECK(why.find("is trainstreamd running?") != std::string::npos);
  bool closed = true;
  CHECK(platform::DescribeEndpointUnreachable(file, &closed).find(file) != std::string::npos);
  CHECK_FALSE(closed);
}

TEST_CASE("on Windows a file that is not an endpoint file is refused", "[control_channel]") {
  TempFolder folder;
  const std::string file = folder.file("bad.endpoint");
  std::ofstream(fs::u8path(file)) << "not an endpoint\n";
  platform::ControlTarget target;
  std::string why;
  CHECK(platform::ResolveControlTarget(file, &target, &why) == EINVAL);
  CHECK(why.find("is not a trainstream endpoint file") != std::string::npos);
}

TEST_CASE("on Windows a stale endpoint file names the address nobody answers at",
          "[control_channel]") {
  TempFolder folder;
  std::string secret, address;
  REQUIRE(platform::NewEndpointSecret(&secret) == 0);
  {
    SecretCheckingServer gone(secret);
    address = gone.address();
  }
  const std::string file = folder.file("stale.endpoint");
  REQUIRE(platform::WriteEndpointFile(file, {address, secret}) == 0);
  bool closed = true;
  const std::string why = platform::DescribeEndpointUnreachable(file, &closed);
  CHECK(why.find("nothing answers at " + address) != std::string::npos);
}

TEST_CASE("on Windows TRAINSTREAM_SOCKET names the endpoint file", "[control_channel]") {
  _putenv_s("TRAINSTREAM_SOCKET", "C:\\x\\y.endpoint");
  CHECK(platform::DefaultControlEndpoint() == "C:\\x\\y.endpoint");
  _putenv_s("TRAINSTREAM_SOCKET", "");
  const std::string embedded = platform::EmbeddedControlEndpoint();
  CHECK(embedded.size() > std::string("\\TrainStream\\trainstreamd.endpoint").size());
  CHECK(embedded.find("\\TrainStream\\trainstreamd.endpoint") != std::string::npos);
}

TEST_CASE("on Windows a privileged daemon serves in ProgramData, another in its profile",
          "[control_channel]") {
  _putenv_s("TRAINSTREAM_SOCKET", "C:\\x\\d.endpoint");
  CHECK(platform::DefaultDaemonEndpoint() == "C:\\x\\d.endpoint");
  _putenv_s("TRAINSTREAM_SOCKET", "");
  const std::string endpoint = platform::DefaultDaemonEndpoint();
  if (platform::RunsPrivileged()) {
    CHECK(endpoint != platform::EmbeddedControlEndpoint());
    const char* program_data = std::getenv("ProgramData");
    REQUIRE(program_data != nullptr);
    CHECK(endpoint == std::string(program_data) + "\\TrainStream\\trainstreamd.endpoint");
  } else {
    CHECK(endpoint == platform::EmbeddedControlEndpoint());
  }
}
