// The Windows side of the control channel's seam
// (trainstream/platform/control_channel.h): the endpoint is the daemon's
// endpoint file (platform/endpoint.h), which names a loopback address and the
// secret every call carries (Note [A secret in an owner-only file stands in
// for SO_PEERCRED]).
#include <windows.h>
// windows.h first: shlobj.h needs its types.
#include <knownfolders.h>
#include <shlobj.h>

#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <system_error>

#include "trainstream/platform/control_channel.h"
#include "trainstream/platform/endpoint.h"
#include "trainstream/platform/sys_call.h"
#include "trainstream/platform/user.h"

namespace trainstream::platform {
namespace {

constexpr char kEndpointFileName[] = "trainstreamd.endpoint";

// A known folder (%LOCALAPPDATA%, %ProgramData%) as UTF-8; "" when the system
// has none.
std::string KnownFolder(REFKNOWNFOLDERID id) {
  PWSTR wide = nullptr;
  std::string path;
  if (SHGetKnownFolderPath(id, 0, nullptr, &wide) == S_OK) {
    path = std::filesystem::path(wide).u8string();
  }
  CoTaskMemFree(wide);
  return path;
}

std::string SystemControlEndpoint() {
  return KnownFolder(FOLDERID_ProgramData) + "\\TrainStream\\" + kEndpointFileName;
}

const char kStartHint[] =
    "is trainstreamd running? Start it with `trainstreamd`, or the service with `sc start "
    "trainstreamd`; or set TRAINSTREAM_SOCKET to the endpoint file of a trainstreamd you may use";

}  // namespace

std::string EmbeddedControlEndpoint() {
  return KnownFolder(FOLDERID_LocalAppData) + "\\TrainStream\\" + kEndpointFileName;
}

std::string DefaultControlEndpoint() {
  if (const char* env = std::getenv("TRAINSTREAM_SOCKET"); env != nullptr && *env != '\0') {
    return env;
  }
  const std::string system = SystemControlEndpoint();
  std::error_code ec;
  if (std::filesystem::exists(std::filesystem::u8path(system), ec)) return system;
  return EmbeddedControlEndpoint();
}

std::string DefaultDaemonEndpoint() {
  if (const char* env = std::getenv("TRAINSTREAM_SOCKET"); env != nullptr && *env != '\0') {
    return env;
  }
  return RunsPrivileged() ? SystemControlEndpoint() : EmbeddedControlEndpoint();
}

int ResolveControlTarget(const std::string& endpoint, ControlTarget* out, std::string* why) {
  Endpoint e;
  std::string bad;
  const int err = ReadEndpointFile(endpoint, &e, &bad);
  if (err == ENOENT) {
    *why = "there is no endpoint file " + endpoint + " (" + kStartHint + ")";
  } else if (err == EINVAL) {
    *why = bad;
  } else if (err != 0) {
    *why = ErrnoText("cannot read the endpoint file " + endpoint, err);
  }
  if (err != 0) return err;
  out->grpc_target = e.address;
  out->secret = e.secret;
  return 0;
}

std::string DescribeEndpointAccessDenied(const std::string& endpoint) {
  const std::wstring wide = std::filesystem::u8path(endpoint).wstring();
  HANDLE file = CreateFileW(wide.c_str(), GENERIC_READ, FILE_SHARE_READ | FILE_SHARE_DELETE,
                            nullptr, OPEN_EXISTING, FILE_ATTRIBUTE_NORMAL, nullptr);
  if (file != INVALID_HANDLE_VALUE) {
    CloseHandle(file);
    return "";
  }
  if (GetLastError() != ERROR_ACCESS_DENIED) return "";
  return "trainstreamd's endpoint file " + endpoint +
         " exists, but this user may not read it: only the user the daemon runs as may (its "
         "DACL names that user alone); run as that user, or set TRAINSTREAM_SOCKET to the "
         "endpoint file of a trainstreamd you may use";
}

std::string DescribeEndpointUnreachable(const std::string& endpoint, bool* closed_at_once) {
  *closed_at_once = false;
  ControlTarget target;
  std::string why;
  if (ResolveControlTarget(endpoint, &target, &why) != 0) return why;
  return "nothing answers at " + target.grpc_target + ", the address the endpoint file " +
         endpoint + " names (a stale file: " + kStartHint + ")";
}

}  // namespace trainstream::platform
