// trainstreamd: command line, logging and daemonisation; the daemon itself is
// RunDaemon (daemon.cc).
#include <fcntl.h>
#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>

#include "config.h"
#include "daemon.h"
#include "trainstream/platform/stop_signals.h"

namespace {

int g_ready_fd = -1;  // write end of the pipe the waiting parent reads (background mode)

void ReportReady(const char* error) {
  if (g_ready_fd < 0) return;
  std::string msg = error == nullptr ? std::string("ok") : std::string(error);
  ssize_t ignored = write(g_ready_fd, msg.data(), msg.size());
  (void)ignored;
  close(g_ready_fd);
  g_ready_fd = -1;
  if (error == nullptr) {
    // Detach from the terminal now that the parent has the result.
    int devnull = open("/dev/null", O_RDWR | O_CLOEXEC);
    if (devnull >= 0) {
      dup2(devnull, STDIN_FILENO);
      dup2(devnull, STDOUT_FILENO);
      dup2(devnull, STDERR_FILENO);
      close(devnull);
    }
  }
}

// Background mode: fork before any thread exists; the parent waits for the
// child to report readiness (or its error) and exits with the result.
bool Daemonize(int* exit_code) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return false;
  pid_t pid = fork();
  if (pid < 0) return false;
  if (pid > 0) {
    close(fds[1]);
    std::string msg;
    char buf[512];
    ssize_t n;
    while ((n = read(fds[0], buf, sizeof(buf))) > 0) msg.append(buf, static_cast<size_t>(n));
    if (msg == "ok") {
      *exit_code = 0;
    } else {
      std::fprintf(stderr, "trainstreamd: %s\n",
                   msg.empty() ? "exited during startup" : msg.c_str());
      *exit_code = 1;
    }
    return true;
  }
  close(fds[0]);
  setsid();
  g_ready_fd = fds[1];
  return false;
}

// Each connection and each segment holds an fd, and the soft limit is often
// 1024 under a hard limit of 512Ki: take what we may (Note [Accepting under a
// connection flood] in unix_listener.h).
void RaiseOpenFileLimit() {
  rlimit lim{};
  if (getrlimit(RLIMIT_NOFILE, &lim) != 0) return;
  if (lim.rlim_cur >= lim.rlim_max) {
    spdlog::info("open-file limit {} (the hard limit)", static_cast<uint64_t>(lim.rlim_cur));
    return;
  }
  const rlim_t old_soft = lim.rlim_cur;
  lim.rlim_cur = lim.rlim_max;
  if (setrlimit(RLIMIT_NOFILE, &lim) != 0) {
    spdlog::warn("cannot raise the open-file limit from {} to {}: {}",
                 static_cast<uint64_t>(old_soft), static_cast<uint64_t>(lim.rlim_max),
                 std::strerror(errno));
    return;
  }
  spdlog::info("raised the open-file limit from {} to the hard limit {}",
               static_cast<uint64_t>(old_soft), static_cast<uint64_t>(lim.rlim_max));
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
  bool foreground = false;
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
  // A flag given twice takes the last value (wrappers append overrides).
  for (CLI::Option* opt : app.get_options())
    opt->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  CLI11_PARSE(app, argc, argv);

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

  int exit_code = 0;
  if (!config.foreground && Daemonize(&exit_code)) return exit_code;

  // SIGTERM, SIGINT, SIGHUP and SIGUSR2 (a restart: Note [A restart keeps the
  // optimizer state]) arrive through StopSignals, made before any thread starts
  // so that every thread inherits their mask.
  std::unique_ptr<trainstream::platform::StopSignals> stop_signals;
  if (int err = trainstream::platform::StopSignals::Create(&stop_signals); err != 0) {
    const std::string msg = std::string("cannot receive signals: ") + std::strerror(err);
    if (config.foreground) std::fprintf(stderr, "trainstreamd: %s\n", msg.c_str());
    ReportReady(msg.c_str());  // background mode: the waiting parent prints it
    return 1;
  }

  std::vector<spdlog::sink_ptr> sinks;
  sinks.push_back(std::make_shared<spdlog::sinks::stderr_color_sink_mt>());
  if (!log_file.empty())
    sinks.push_back(std::make_shared<spdlog::sinks::basic_file_sink_mt>(log_file));
  auto logger = std::make_shared<spdlog::logger>("trainstreamd", sinks.begin(), sinks.end());
  logger->set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%l%$ trainstreamd[%P]: %v");
  logger->set_level(spdlog::level::from_str(config.log_level));
  logger->flush_on(spdlog::level::info);
  spdlog::set_default_logger(logger);
  RaiseOpenFileLimit();

  return trainstream::daemon::RunDaemon(config, stop_signals.get(), ReportReady);
}
