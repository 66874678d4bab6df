// The platform seam's default control endpoints: where a client looks for the
// daemon, and where a daemon serves, when nobody names an endpoint
// (TRAINSTREAM_SOCKET, --socket). What an endpoint is on each system, and how
// a client reaches one, is platform/control_channel.h; these functions live
// in its library (trainstream_platform_control) but need no gRPC, so the
// daemon's layers below the transport may call them.
#pragma once

#include <string>

namespace trainstream::platform {

// The endpoint a client uses when none is given. Linux: $TRAINSTREAM_SOCKET,
// else the system service's /run/trainstream/trainstreamd.sock if it exists
// (or its directory keeps this uid out: connecting then says so), else the
// per-user embedded socket. Windows: %TRAINSTREAM_SOCKET% (an endpoint file),
// else the system service's %ProgramData%\TrainStream\trainstreamd.endpoint
// if it exists, else the per-user one.
std::string DefaultControlEndpoint();

// The per-user embedded daemon's endpoint, whether or not it exists. Linux:
// $XDG_RUNTIME_DIR/trainstream/trainstreamd.sock, else
// /tmp/trainstream-$UID/trainstreamd.sock. Windows:
// %LOCALAPPDATA%\TrainStream\trainstreamd.endpoint.
std::string EmbeddedControlEndpoint();

// Where a daemon started with no endpoint given serves. Linux:
// $TRAINSTREAM_SOCKET, else /run/trainstream/trainstreamd.sock for root, else
// the embedded socket above. Windows: %TRAINSTREAM_SOCKET%, else the system
// service's file in %ProgramData% for a privileged daemon (LocalSystem,
// platform/user.h), else the per-user one.
std::string DefaultDaemonEndpoint();

}  // namespace trainstream::platform
