// The service seam (trainstream/platform/service.h) against the system's
// service control manager: install, start, stop, uninstall a real service
// (platform_service_host.exe, built beside this test), and the errors a user
// can meet. Windows only: on Linux the seam has no services.
#include <windows.h>

#include <chrono>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#include "catch_compat.h"
#include "trainstream/platform/service.h"

using namespace trainstream::platform;
using namespace std::chrono_literals;

namespace {

std::string ThisFolder() {
  char path[MAX_PATH];
  const DWORD n = GetModuleFileNameA(nullptr, path, MAX_PATH);
  std::string s(path, n);
  return s.substr(0, s.find_last_of("\\/") + 1);
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Polls the service's state until it is `want` or 30 s passed; returns the last.
DWORD WaitForState(SC_HANDLE service, DWORD want, SERVICE_STATUS* status) {
  const auto deadline = std::chrono::steady_clock::now() + 30s;
  for (;;) {
    if (!QueryServiceStatus(service, status)) return 0;
    if (status->dwCurrentState == want || std::chrono::steady_clock::now() > deadline) {
      return status->dwCurrentState;
    }
    std::this_thread::sleep_for(50ms);
  }
}

}  // namespace

TEST_CASE("services exist on this system", "[service]") { CHECK(HasServices()); }

TEST_CASE("RunAsService outside the SCM says how to start the service", "[service]") {
  std::string error;
  bool ran = false;
  const int code = RunAsService(
      "trainstream-not-started", [](StopRequest) {},
      [&](ServiceReporter*) {
        ran = true;
        return 0;
      },
      &error);
  CHECK(code == -1);
  CHECK(!ran);
  CHECK(error.find("not started by the service control manager") != std::string::npos);
  CHECK(error.find("sc start trainstream-not-started") != std::string::npos);
}

TEST_CASE("a bad service name is refused with the rule", "[service]") {
  ServiceDefinition def;
  std::string error;
  def.name = "";
  CHECK(!InstallService(def, &error));
  CHECK(error.find("1 to 256 characters") != std::string::npos);
  def.name = "a/b";
  CHECK(!InstallService(def, &error));
  CHECK(error.find("'a/b'") != std::string::npos);
  CHECK(!UninstallService(std::string(300, 'x'), nullptr, &error));
}

TEST_CASE("uninstalling a service that is not there names it", "[service]") {
  std::string error;
  CHECK(!UninstallService("trainstream-no-such-service", nullptr, &error));
  CHECK(error.find("'trainstream-no-such-service'") != std::string::npos);
  CHECK(error.find("error 1060") != std::string::npos);  // ERROR_SERVICE_DOES_NOT_EXIST
}

TEST_CASE("install, start, stop on a service stop, uninstall", "[service]") {
  const std::string name = "trainstream-test-" + std::to_string(GetCurrentProcessId());
  char temp[MAX_PATH];
  REQUIRE(GetTempPathA(MAX_PATH, temp) != 0);
  // A space in the path: the command line is quoted for it.
  const std::string marker = std::string(temp) + "trainstream service " + name + ".txt";
  DeleteFileA(marker.c_str());

  ServiceDefinition def;
  def.name = name;
  def.display_name = "TrainStream service test " + name;
  def.description = "platform_service_test's service; removed by the test";
  def.program = ThisFolder() + "platform_service_host.exe";
  def.arguments = {name, marker};
  def.start_with_system = false;
  std::string error;
  if (!InstallService(def, &error)) FAIL(error);
  const bool again = InstallService(def, &error);
  INFO(error);
  CHECK(!again);
  CHECK(error.find("installing service '" + name + "'") != std::string::npos);
  CHECK(error.find("error 1073") != std::string::npos);  // ERROR_SERVICE_EXISTS

  SC_HANDLE scm = OpenSCManagerA(nullptr, nullptr, SC_MANAGER_CONNECT);
  REQUIRE(scm != nullptr);
  SC_HANDLE service =
      OpenServiceA(scm, name.c_str(), SERVICE_START | SERVICE_STOP | SERVICE_QUERY_STATUS);
  REQUIRE(service != nullptr);
  const bool started = StartServiceA(service, 0, nullptr);
  INFO("StartService: error " << GetLastError());
  REQUIRE(started);
  SERVICE_STATUS status{};
  CHECK(WaitForState(service, SERVICE_RUNNING, &status) == SERVICE_RUNNING);
  CHECK((status.dwControlsAccepted & SERVICE_ACCEPT_STOP) != 0);
  CHECK((status.dwControlsAccepted & SERVICE_ACCEPT_SHUTDOWN) != 0);

  REQUIRE(ControlService(service, SERVICE_CONTROL_STOP, &status));
  CHECK(WaitForState(service, SERVICE_STOPPED, &status) == SERVICE_STOPPED);
  CHECK(status.dwWin32ExitCode == NO_ERROR);
  CHECK(ReadAll(marker) == "running\nstopped: service stop\n");
  CloseServiceHandle(service);
  CloseServiceHandle(scm);

  bool still_running = true;
  if (!UninstallService(name, &still_running, &error)) FAIL(error);
  CHECK(!still_running);
  CHECK(!UninstallService(name, nullptr, &error));
  DeleteFileA(marker.c_str());
}
