// The Windows side of the service seam (trainstream/platform/service.h).
//
// Note [The daemon as a Windows service]. The SCM starts the registered
// command line (the program and its arguments, which include the daemon's
// --service), and the program calls StartServiceCtrlDispatcherW, which does not
// return until the service has stopped. Meanwhile the dispatcher runs
// ServiceMain on a thread of its own, and the control handler on the thread
// that called the dispatcher. So:
//   ServiceMain      registers the control handler, reports START_PENDING,
//                    runs the caller's `run` (the daemon: RunDaemon), and
//                    reports STOPPED with its exit code when it returns
//   ReportRunning    (from `run`, once the daemon serves) reports RUNNING and
//                    accepts STOP and SHUTDOWN from then on
//   control handler  STOP and SHUTDOWN: reports STOP_PENDING and calls
//                    `on_stop`, which only queues the request for the daemon's
//                    main loop (Note [No code in signal handlers]); the main
//                    loop runs the shutdown (tell sessions, remove segments),
//                    as for SIGTERM
// A process runs at most one service (SERVICE_WIN32_OWN_PROCESS), so what
// ServiceMain needs is one static Context, set for the dispatcher's lifetime.
// The handler's SetServiceStatus calls and ServiceMain's are serialized by the
// context's mutex: the SCM takes the last one, and a STOP_PENDING must not
// overwrite the STOPPED already sent.
#include <windows.h>

#include <cerrno>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "trainstream/platform/service.h"

namespace trainstream::platform {
namespace {

constexpr DWORD kStartWaitHintMs = 30000;  // how long the SCM waits for RUNNING
constexpr DWORD kStopWaitHintMs = 10000;   // and for STOPPED after a stop

std::wstring Wide(const std::string& utf8) {
  if (utf8.empty()) return std::wstring();
  const int n =
      MultiByteToWideChar(CP_UTF8, 0, utf8.data(), static_cast<int>(utf8.size()), nullptr, 0);
  std::wstring out(static_cast<size_t>(n), L'\0');
  MultiByteToWideChar(CP_UTF8, 0, utf8.data(), static_cast<int>(utf8.size()), out.data(), n);
  return out;
}

std::string Narrow(const std::wstring& wide) {
  if (wide.empty()) return std::string();
  const int n = WideCharToMultiByte(CP_UTF8, 0, wide.data(), static_cast<int>(wide.size()), nullptr,
                                    0, nullptr, nullptr);
  std::string out(static_cast<size_t>(n), '\0');
  WideCharToMultiByte(CP_UTF8, 0, wide.data(), static_cast<int>(wide.size()), out.data(), n,
                      nullptr, nullptr);
  return out;
}

// "<what>: <the system's message> (error <code>)".
std::string Describe(const std::string& what, DWORD code) {
  wchar_t* text = nullptr;
  const DWORD n = FormatMessageW(
      FORMAT_MESSAGE_ALLOCATE_BUFFER | FORMAT_MESSAGE_FROM_SYSTEM | FORMAT_MESSAGE_IGNORE_INSERTS,
      nullptr, code, 0, reinterpret_cast<wchar_t*>(&text), 0, nullptr);
  std::string message;
  if (n != 0 && text != nullptr) {
    message = Narrow(std::wstring(text, n));
    while (!message.empty() && (message.back() == '\n' || message.back() == '\r' ||
                                message.back() == '.' || message.back() == ' ')) {
      message.pop_back();
    }
  }
  if (text != nullptr) LocalFree(text);
  if (message.empty()) message = "system error";
  return what + ": " + message + " (error " + std::to_string(code) + ")";
}

// One argument as CommandLineToArgvW reads it back: quoted when it holds a
// space, a tab or a quote (or is empty), each quote escaped, and the
// backslashes before a quote or the closing quote doubled.
std::wstring QuoteArgument(const std::wstring& arg) {
  if (!arg.empty() && arg.find_first_of(L" \t\"") == std::wstring::npos) return arg;
  std::wstring out = L"\"";
  size_t backslashes = 0;
  for (wchar_t c : arg) {
    if (c == L'\\') {
      ++backslashes;
      continue;
    }
    if (c == L'"')
      out.append(backslashes * 2 + 1, L'\\');
    else
      out.append(backslashes, L'\\');
    backslashes = 0;
    out.push_back(c);
  }
  out.append(backslashes * 2, L'\\');
  out.push_back(L'"');
  return out;
}

bool ValidName(const std::string& name, std::string* error) {
  if (name.empty() || name.size() > 256 || name.find_first_of("/\\") != std::string::npos) {
    *error = "service name '" + name + "': 1 to 256 characters, none of them '/' or '\\'";
    return false;
  }
  return true;
}

// Closes an SCM handle on scope exit.
struct ScHandle {
  SC_HANDLE h = nullptr;
  explicit ScHandle(SC_HANDLE handle) : h(handle) {}
  ~ScHandle() {
    if (h != nullptr) CloseServiceHandle(h);
  }
  ScHandle(const ScHandle&) = delete;
  ScHandle& operator=(const ScHandle&) = delete;
};

class Context final : public ServiceReporter {
 public:
  Context(std::wstring name, std::function<void(StopRequest)> on_stop,
          std::function<int(ServiceReporter*)> run)
      : name_(std::move(name)), on_stop_(std::move(on_stop)), run_(std::move(run)) {}

  void Main();
  void ReportRunning() override { Report(SERVICE_RUNNING, NO_ERROR, 0, 0); }
  int exit_code() const { return exit_code_; }
  const std::string& error() const { return error_; }

  static DWORD WINAPI OnControl(DWORD control, DWORD, void*, void* context);

 private:
  void Report(DWORD state, DWORD win32_exit, DWORD service_exit, DWORD wait_hint);

  const std::wstring name_;
  const std::function<void(StopRequest)> on_stop_;
  const std::function<int(ServiceReporter*)> run_;
  SERVICE_STATUS_HANDLE status_handle_ = nullptr;  // set by Main before any Report
  std::mutex mu_;
  DWORD state_ = SERVICE_START_PENDING;  // the last state reported. Guarded by mu_.
  DWORD checkpoint_ = 0;                 // Guarded by mu_.
  int exit_code_ = 0;
  std::string error_;
};

Context* g_context = nullptr;  // set while RunAsService's dispatcher runs

void Context::Report(DWORD state, DWORD win32_exit, DWORD service_exit, DWORD wait_hint) {
  std::lock_guard<std::mutex> lock(mu_);
  if (state_ == SERVICE_STOPPED) return;  // the last word was said
  state_ = state;
  SERVICE_STATUS status{};
  status.dwServiceType = SERVICE_WIN32_OWN_PROCESS;
  status.dwCurrentState = state;
  // Stop and shutdown are accepted only once running: before that the daemon
  // has no main loop to hand them to.
  status.dwControlsAccepted =
      state == SERVICE_RUNNING ? SERVICE_ACCEPT_STOP | SERVICE_ACCEPT_SHUTDOWN : 0;
  status.dwWin32ExitCode = win32_exit;
  status.dwServiceSpecificExitCode = service_exit;
  const bool pending = state == SERVICE_START_PENDING || state == SERVICE_STOP_PENDING;
  status.dwCheckPoint = pending ? ++checkpoint_ : 0;
  status.dwWaitHint = wait_hint;
  SetServiceStatus(status_handle_, &status);
}

DWORD WINAPI Context::OnControl(DWORD control, DWORD, void*, void* context) {
  auto* self = static_cast<Context*>(context);
  switch (control) {
    case SERVICE_CONTROL_STOP:
      self->Report(SERVICE_STOP_PENDING, NO_ERROR, 0, kStopWaitHintMs);
      self->on_stop_({StopKind::kTerminate, "service stop"});
      return NO_ERROR;
    case SERVICE_CONTROL_SHUTDOWN:
      self->Report(SERVICE_STOP_PENDING, NO_ERROR, 0, kStopWaitHintMs);
      self->on_stop_({StopKind::kShutdown, "system shutdown"});
      return NO_ERROR;
    case SERVICE_CONTROL_INTERROGATE:
      return NO_ERROR;
    default:
      return ERROR_CALL_NOT_IMPLEMENTED;
  }
}

void Context::Main() {
  status_handle_ = RegisterServiceCtrlHandlerExW(name_.c_str(), &Context::OnControl, this);
  if (status_handle_ == nullptr) {
    error_ = Describe("RegisterServiceCtrlHandlerExW", GetLastError());
    exit_code_ = -1;
    return;
  }
  Report(SERVICE_START_PENDING, NO_ERROR, 0, kStartWaitHintMs);
  exit_code_ = run_(this);
  if (exit_code_ == 0) {
    Report(SERVICE_STOPPED, NO_ERROR, 0, 0);
  } else {
    Report(SERVICE_STOPPED, ERROR_SERVICE_SPECIFIC_ERROR, static_cast<DWORD>(exit_code_), 0);
  }
}

void WINAPI ServiceMain(DWORD, wchar_t**) { g_context->Main(); }

}  // namespace

bool HasServices() { return true; }

bool InstallService(const ServiceDefinition& definition, std::string* error) {
  if (!ValidName(definition.name, error)) return false;
  std::wstring program = Wide(definition.program);
  if (program.empty()) {
    std::vector<wchar_t> path(MAX_PATH);
    for (;;) {
      const DWORD n = GetModuleFileNameW(nullptr, path.data(), static_cast<DWORD>(path.size()));
      if (n == 0) {
        *error = Describe("the path of this program (GetModuleFileNameW)", GetLastError());
        return false;
      }
      if (n < path.size()) {
        program.assign(path.data(), n);
        break;
      }
      path.resize(path.size() * 2);
    }
  }
  std::wstring command_line = QuoteArgument(program);
  for (const auto& arg : definition.arguments) command_line += L" " + QuoteArgument(Wide(arg));

  ScHandle scm(OpenSCManagerW(nullptr, nullptr, SC_MANAGER_CREATE_SERVICE));
  if (scm.h == nullptr) {
    *error = Describe("opening the service control manager to install service '" + definition.name +
                          "' (run it as an administrator)",
                      GetLastError());
    return false;
  }
  const std::wstring name = Wide(definition.name);
  const std::wstring display =
      Wide(definition.display_name.empty() ? definition.name : definition.display_name);
  ScHandle service(CreateServiceW(
      scm.h, name.c_str(), display.c_str(), SERVICE_CHANGE_CONFIG, SERVICE_WIN32_OWN_PROCESS,
      definition.start_with_system ? SERVICE_AUTO_START : SERVICE_DEMAND_START,
      SERVICE_ERROR_NORMAL, command_line.c_str(), nullptr, nullptr, nullptr, nullptr, nullptr));
  if (service.h == nullptr) {
    *error = Describe("installing service '" + definition.name + "'", GetLastError());
    return false;
  }
  if (!definition.description.empty()) {
    std::wstring text = Wide(definition.description);
    SERVICE_DESCRIPTIONW description{text.data()};
    if (!ChangeServiceConfig2W(service.h, SERVICE_CONFIG_DESCRIPTION, &description)) {
      *error = Describe("service '" + definition.name + "' is installed, but its description",
                        GetLastError());
      return false;
    }
  }
  return true;
}

bool UninstallService(const std::string& name, bool* still_running, std::string* error) {
  if (!ValidName(name, error)) return false;
  ScHandle scm(OpenSCManagerW(nullptr, nullptr, SC_MANAGER_CONNECT));
  if (scm.h == nullptr) {
    *error = Describe("opening the service control manager to remove service '" + name + "'",
                      GetLastError());
    return false;
  }
  ScHandle service(OpenServiceW(scm.h, Wide(name).c_str(), DELETE | SERVICE_QUERY_STATUS));
  if (service.h == nullptr) {
    *error = Describe("opening service '" + name + "' to remove it", GetLastError());
    return false;
  }
  SERVICE_STATUS status{};
  const bool running =
      QueryServiceStatus(service.h, &status) && status.dwCurrentState != SERVICE_STOPPED;
  if (!DeleteService(service.h)) {
    *error = Describe("removing service '" + name + "'", GetLastError());
    return false;
  }
  if (still_running != nullptr) *still_running = running;
  return true;
}

int RunAsService(const std::string& name, std::function<void(StopRequest)> on_stop,
                 std::function<int(ServiceReporter* reporter)> run, std::string* error) {
  if (!ValidName(name, error)) return -1;
  if (g_context != nullptr) {
    *error = "RunAsService: a service already runs in this process";
    return -1;
  }
  std::wstring wide_name = Wide(name);
  auto context = std::make_unique<Context>(wide_name, std::move(on_stop), std::move(run));
  g_context = context.get();
  SERVICE_TABLE_ENTRYW table[] = {{wide_name.data(), &ServiceMain}, {nullptr, nullptr}};
  const bool dispatched = StartServiceCtrlDispatcherW(table) != 0;
  const DWORD code = GetLastError();
  g_context = nullptr;
  if (!dispatched) {
    *error = code == ERROR_FAILED_SERVICE_CONTROLLER_CONNECT
                 ? "service '" + name +
                       "': this process was not started by the service control manager "
                       "(install it with --install-service, then `sc start " +
                       name + "`)"
                 : Describe("service '" + name + "': StartServiceCtrlDispatcherW", code);
    return -1;
  }
  if (!context->error().empty()) {
    *error = "service '" + name + "': " + context->error();
    return -1;
  }
  return context->exit_code();
}

}  // namespace trainstream::platform
