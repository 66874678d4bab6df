// The Linux side of the control channel (control_channel_linux.cc): the
// endpoint is the unix socket itself, and calls carry no secret.
#include <unistd.h>

#include <cstdlib>
#include <string>

#include "catch_compat.h"
#include "trainstream/platform/control_channel.h"

namespace platform = trainstream::platform;

TEST_CASE("on Linux an endpoint is a unix socket, with no secret", "[control_channel]") {
  platform::ControlTarget target{"stale", "stale"};
  std::string why;
  REQUIRE(platform::ResolveControlTarget("/run/x/trainstreamd.sock", &target, &why) == 0);
  CHECK(target.grpc_target == "unix:/run/x/trainstreamd.sock");
  CHECK(target.secret.empty());
}

TEST_CASE("on Linux a missing socket is named as missing", "[control_channel]") {
  bool closed = true;
  const std::string why =
      platform::DescribeEndpointUnreachable("/nonexistent/trainstreamd.sock", &closed);
  CHECK_FALSE(closed);
  CHECK(why.find("does not exist") != std::string::npos);
  CHECK(platform::DescribeEndpointAccessDenied("/nonexistent/trainstreamd.sock").empty());
}

TEST_CASE("on Linux TRAINSTREAM_SOCKET and XDG_RUNTIME_DIR pick the endpoint",
          "[control_channel]") {
  setenv("TRAINSTREAM_SOCKET", "/tmp/x/y.sock", 1);
  CHECK(platform::DefaultControlEndpoint() == "/tmp/x/y.sock");
  unsetenv("TRAINSTREAM_SOCKET");
  setenv("XDG_RUNTIME_DIR", "/run/user/1234", 1);
  CHECK(platform::EmbeddedControlEndpoint() == "/run/user/1234/trainstream/trainstreamd.sock");
  unsetenv("XDG_RUNTIME_DIR");
}

TEST_CASE("on Linux a daemon serves at TRAINSTREAM_SOCKET, else root's or the user's socket",
          "[control_channel]") {
  setenv("TRAINSTREAM_SOCKET", "/tmp/x/d.sock", 1);
  CHECK(platform::DefaultDaemonEndpoint() == "/tmp/x/d.sock");
  unsetenv("TRAINSTREAM_SOCKET");
  if (geteuid() == 0) {
    CHECK(platform::DefaultDaemonEndpoint() == "/run/trainstream/trainstreamd.sock");
  } else {
    CHECK(platform::DefaultDaemonEndpoint() == platform::EmbeddedControlEndpoint());
  }
}
