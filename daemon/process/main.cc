// trainstreamd: command line, logging and daemonisation; the daemon itself is
// RunDaemon (daemon.cc).
#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "process/config.h"
#include "process/daemon.h"
#include "trainstream/platform/background.h"
#include "trainstream/platform/default_endpoint.h"
#include "trainstream/platform/service.h"
#include "trainstream/platform/stop_signals.h"
#include "trainstream/platform/sys_call.h"
#include "trainstream/platform/this_process.h"

namespace {

constexpr char kServiceName[] = "trainstreamd";

// Each connection and each segment holds an fd, and the soft limit is often
// 1024 under a hard limit of 512Ki: take what we may (Note [Accepting under a
// connection flood] in control_listener.h). Windows has no such limit.
void RaiseOpenFileLimit() {
  uint64_t from = 0, to = 0;
  const int err = trainstream::platform::RaiseOpenFileLimit(&from, &to);
  if (err == ENOTSUP) return;
  if (err != 0) {
    spdlog::warn("cannot raise the open-file limit from {} to {}: {}", from, to,
                 trainstream::platform::ErrnoMessage(err));
  } else if (from == to) {
    spdlog::info("open-file limit {} (the hard limit)", from);
  } else {
    spdlog::info("raised the open-file limit from {} to the hard limit {}", from, to);
  }
}

// --install-service: the SCM starts this program with --service and the
// options given here (Note [The daemon as a Windows service], service.h).
int InstallService(const std::vector<std::string>& daemon_args) {
  trainstream::platform::ServiceDefinition def;
  def.name = kServiceName;
  def.display_name = "TrainStream daemon";
  def.description = "TrainStream's per-machine memory and optimizer daemon (trainstreamd)";
  def.arguments.push_back("--service");
  def.arguments.insert(def.arguments.end(), daemon_args.begin(), daemon_args.end());
  std::string error;
  if (!trainstream::platform::InstallService(def, &error)) {
    std::fprintf(stderr, "trainstreamd: %s\n", error.c_str());
    return 1;
  }
  std::printf("installed the service %s; start it with `sc start %s`\n", kServiceName,
              kServiceName);
  return 0;
}

int UninstallService() {
  bool still_running = false;
  std::string error;
  if (!trainstream::platform::UninstallService(kServiceName, &still_running, &error)) {
    std::fprintf(stderr, "trainstreamd: %s\n", error.c_str());
    return 1;
  }
  std::printf("removed the service %s%s\n", kServiceName,
              still_running ? " (it still runs: it goes once it stops)" : "");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  using trainstream::daemon::DaemonConfig;
  CLI::App app{
      "trainstreamd: the TrainStream per-machine memory and optimizer daemon (docs/daemon.md)"};
  std::string config_path, socket, budget, log_level, shm_dir, allow_group, admin_group, log_file;
  unsigned threads = 0, load_threads = 0;
  uint64_t idle_exit = 0;
  uint32_t max_connections_per_uid = 0;
  uint64_t recovery_grace = 0;
  bool foreground = false, as_service = false, install_service = false, uninstall_service = false;
  app.add_option("--config", config_path, "Config file (key = value lines; docs/daemon.md)");
  app.add_option("--socket", socket,
                 "Unix socket to serve (default: /run/trainstream/trainstreamd.sock for root, "
                 "else the per-user embedded socket; $TRAINSTREAM_SOCKET overrides)");
  app.add_flag("--foreground,-f", foreground, "Stay in the foreground and log to stderr");
  app.add_option("--budget", budget,
                 "Machine-wide memory budget: bytes, K/M/G/T suffix, or NN% of RAM (default 50%)");
  app.add_option("--log-level", log_level,
                 "trace, debug, info, warn, error, critical or off (default info)");
  app.add_option("--log-file", log_file, "Also append logs to this file");
  app.add_option("--shm-dir", shm_dir, "Directory for segments (default /dev/shm)");
  app.add_option("--threads", threads, "Optimizer worker threads (default: one per core)");
  app.add_option("--load-threads", load_threads,
                 "Threads that read and quantize a base (default 0: one per available CPU)");
  app.add_option("--idle-exit", idle_exit,
                 "Exit after this many seconds with no session and no request (embedded mode)");
  app.add_option("--allow-group", allow_group, "Members of this group may use the daemon");
  app.add_option("--admin-group", admin_group,
                 "Members of this group may also shut the daemon down");
  app.add_option("--max-connections-per-uid", max_connections_per_uid,
                 "Open connections one uid may hold; more are closed at once (default 64; 0: "
                 "no cap)");
  app.add_option("--recovery-grace", recovery_grace,
                 "Seconds an adopted optimizer state of a dead daemon waits for its client "
                 "(default 300; 0: recovery off, docs/recovery.md)");
  app.add_flag("--install-service", install_service,
               "Windows: install trainstreamd as a service (LocalSystem) started with the other "
               "options given here, then exit");
  app.add_flag("--uninstall-service", uninstall_service,
               "Windows: remove the trainstreamd service, then exit");
  app.add_flag("--service", as_service,
               "Windows: run as the service (the service control manager passes it; logs go "
               "to --log-file, by default beside the endpoint file)");
  // A flag given twice takes the last value (wrappers append overrides).
  for (CLI::Option* opt : app.get_options())
    opt->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  CLI11_PARSE(app, argc, argv);
  if (uninstall_service) return UninstallService();
  if (install_service) {
    // Everything but --install-service itself goes to the service's command line.
    std::vector<std::string> daemon_args;
    for (int i = 1; i < argc; ++i) {
      if (std::string(argv[i]) != "--install-service") daemon_args.push_back(argv[i]);
    }
    return InstallService(daemon_args);
  }

  DaemonConfig config;
  if (!config_path.empty()) {
    trainstream::Status s = trainstream::daemon::LoadConfigFile(config_path, &config);
    if (!s.ok()) {
      std::fprintf(stderr, "trainstreamd: %s\n", s.message().c_str());
      return 2;
    }
  }
  if (!socket.empty()) config.socket_path = socket;
  if (!budget.empty()) config.budget = budget;
  if (!log_level.empty()) config.log_level = log_level;
  if (!shm_dir.empty()) config.shm_dir = shm_dir;
  if (app.count("--threads") != 0) config.threads = threads;
  if (app.count("--load-threads") != 0) config.load_threads = load_threads;
  if (app.count("--idle-exit") != 0) config.idle_exit_s = idle_exit;
  if (!allow_group.empty()) config.allow_group = allow_group;
  if (!admin_group.empty()) config.admin_group = admin_group;
  if (app.count("--max-connections-per-uid") != 0)
    config.max_connections_per_uid = max_connections_per_uid;
  if (app.count("--recovery-grace") != 0) config.recovery_grace_s = recovery_grace;
  config.foreground = foreground;
  {
    // Check the merged values once more so a bad flag is reported like a bad file.
    DaemonConfig check = config;
    std::string text =
        "budget = " + config.budget + "\nlog_level = " + config.log_level +
        "\nmax_connections_per_uid = " + std::to_string(config.max_connections_per_uid) +
        "\nload_threads = " + std::to_string(config.load_threads) +
        "\nrecovery_grace = " + std::to_string(config.recovery_grace_s) + "\n";
    trainstream::Status s = trainstream::daemon::ParseConfigText(text, "command line", &check);
    if (!s.ok()) {
      std::fprintf(stderr, "trainstreamd: %s\n", s.message().c_str());
      return 2;
    }
  }

  // A service has no console: it runs in the foreground of its own process.
  if (as_service) config.foreground = true;
  if (!config.foreground) {
    bool is_parent = false;
    int exit_code = 0;
    std::string why;
    const int err = trainstream::platform::StartInBackground(&is_parent, &exit_code, &why);
    if (err == ENOTSUP) {
      std::fprintf(stderr, "trainstreamd: %s\n", why.c_str());
      return 2;
    }
    // Another failure (no pipe, no fork) goes on in this process, as before.
    if (err == 0 && is_parent) return exit_code;
  }

  // SIGTERM, SIGINT, SIGUSR2 (stops that keep the sessions' optimizer state for the
  // next daemon: Note [A restart keeps the optimizer state]) and SIGHUP arrive
  // through StopSignals, made before any thread starts so that every thread
  // inherits their mask.
  std::unique_ptr<trainstream::platform::StopSignals> stop_signals;
  if (int err = trainstream::platform::StopSignals::Create(&stop_signals); err != 0) {
    const std::string msg = trainstream::platform::ErrnoText("cannot receive signals", err);
    if (config.foreground) std::fprintf(stderr, "trainstreamd: %s\n", msg.c_str());
    trainstream::platform::ReportBackgroundReady(msg.c_str());  // the waiting parent prints it
    return 1;
  }

  std::vector<spdlog::sink_ptr> sinks;
  if (as_service) {
    // No stderr: the log file, by default beside the endpoint.
    if (log_file.empty()) {
      const std::string endpoint = config.socket_path.empty()
                                       ? trainstream::platform::DefaultDaemonEndpoint()
                                       : config.socket_path;
      log_file = std::filesystem::u8path(endpoint).replace_extension(".log").u8string();
    }
  } else {
    sinks.push_back(std::make_shared<spdlog::sinks::stderr_color_sink_mt>());
  }
  if (!log_file.empty())
    sinks.push_back(std::make_shared<spdlog::sinks::basic_file_sink_mt>(log_file));
  auto logger = std::make_shared<spdlog::logger>("trainstreamd", sinks.begin(), sinks.end());
  logger->set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%l%$ trainstreamd[%P]: %v");
  logger->set_level(spdlog::level::from_str(config.log_level));
  logger->flush_on(spdlog::level::info);
  spdlog::set_default_logger(logger);
  RaiseOpenFileLimit();

  if (!as_service) {
    return trainstream::daemon::RunDaemon(config, stop_signals.get(),
                                          trainstream::platform::ReportBackgroundReady);
  }
  // Note [The daemon as a Windows service] (platform/service.h): the SCM's
  // stop arrives as a StopRequest, as SIGTERM does (and keeps the sessions'
  // state as SIGTERM does), and the SCM shows the service running once the
  // daemon serves.
  trainstream::platform::StopSignals* stops = stop_signals.get();
  std::string error;
  const int code = trainstream::platform::RunAsService(
      kServiceName,
      [stops](trainstream::platform::StopRequest request) { stops->Deliver(std::move(request)); },
      [&](trainstream::platform::ServiceReporter* reporter) {
        return trainstream::daemon::RunDaemon(config, stops, [reporter](const char* err) {
          if (err == nullptr) {
            reporter->ReportRunning();
          } else {
            spdlog::error("{}", err);
          }
        });
      },
      &error);
  if (code < 0) {
    spdlog::error("{}", error);
    return 2;
  }
  return code;
}
