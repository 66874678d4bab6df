// trainstreamctl: the command-line face of trainstreamd (status, ping, shutdown).
#include <CLI/CLI.hpp>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "base_commands.h"
#include "status_table.h"
#include "trainstream/client.h"
#include "trainstream/platform/sys_call.h"
#include "trainstream/platform/this_process.h"

namespace {

int Fail(const trainstream::Status& s) {
  std::fprintf(stderr, "trainstreamctl: %s\n", s.ToString().c_str());
  switch (s.code()) {
    case trainstream::StatusCode::kUnavailable:
    case trainstream::StatusCode::kDeadlineExceeded:
      return 3;
    case trainstream::StatusCode::kPermissionDenied:
      return 4;
    default:
      return 1;
  }
}

// The trainstreamd installed beside this binary (the same bin/ of a build tree, a
// prefix or a Python environment): what a systemd unit's ExecStart should name.
int PrintDaemonPath() {
  namespace platform = trainstream::platform;
  std::string self;
  if (int err = platform::CurrentExecutablePath(&self); err != 0) {
    std::fprintf(stderr, "trainstreamctl: %s\n",
                 platform::ErrnoText("cannot find this program's own file", err).c_str());
    return 1;
  }
  const std::string path =
      (std::filesystem::u8path(self).parent_path() / platform::ProgramFileName("trainstreamd"))
          .u8string();
  if (!platform::MayExecute(path)) {
    std::fprintf(stderr,
                 "trainstreamctl: no executable trainstreamd beside this trainstreamctl (%s)\n",
                 path.c_str());
    return 1;
  }
  std::printf("%s\n", path.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"trainstreamctl: inspect and control trainstreamd"};
  app.require_subcommand(1);
  std::string socket = trainstream::DefaultSocketPath();
  int timeout_ms = 3000;
  app.add_option("--socket", socket,
                 "Daemon socket (default: $TRAINSTREAM_SOCKET, the system socket, or the "
                 "per-user embedded socket)");
  app.add_option("--timeout-ms", timeout_ms,
                 "How long to wait for the daemon to answer (default 3000)");

  auto* status_cmd =
      app.add_subcommand("status", "Sessions, segments, budget, pinned memory and cached bases");
  bool json = false;
  status_cmd->add_flag("--json", json, "Print JSON (fields: docs/status-json.md)");
  auto* ping_cmd =
      app.add_subcommand("ping", "Check that the daemon answers; prints its version and pid");
  auto* shutdown_cmd = app.add_subcommand(
      "shutdown",
      "Stop the daemon (admins only). With sessions attached, their optimizer state is kept "
      "for the next daemon on this socket, which adopts it for recovery_grace (default 300 s) "
      "so their jobs resume, as after a crash or SIGTERM; --drain or --discard-state stop "
      "cleanly instead (docs/daemon.md, \"Stopping\")");
  bool drain = false, discard_state = false;
  auto* drain_flag = shutdown_cmd->add_flag(
      "--drain", drain,
      "Refuse new sessions and exit cleanly once the last one detaches (adopted states "
      "still waiting for their client are freed then)");
  shutdown_cmd
      ->add_flag("--discard-state", discard_state,
                 "Stop now cleanly: tell the sessions, end them and free their optimizer "
                 "state (and adopted states still waiting); no job can resume")
      ->excludes(drain_flag);
  auto* base_cmd = app.add_subcommand("base", "Frozen bases: load, list, drop");
  base_cmd->require_subcommand(1);
  auto* base_load = base_cmd->add_subcommand(
      "load", "Load a .safetensors file or model folder into the daemon's base cache");
  trainstream::BaseLoadOptions load_options;
  base_load->add_option("path", load_options.path, "Checkpoint file or folder")->required();
  base_load->add_option("--format", load_options.format,
                        "none (default), int8, nf4, fp8 or nvfp4 (block-stack linear weights)");
  base_load->add_option("--block-size", load_options.block_size,
                        "int8/nf4 block size (even, >= 2; default 64)");
  base_load->add_option("--threads", load_options.threads,
                        "Threads that read and quantize (default 0: the daemon's load_threads, "
                        "which is also the most it runs)");
  bool base_json = false;
  base_load->add_flag("--json", base_json, "Print the loaded base as JSON");
  auto* base_list = base_cmd->add_subcommand("list", "Cached bases (yours; all for admins)");
  base_list->add_flag("--json", base_json, "Print JSON");
  auto* base_drop = base_cmd->add_subcommand("drop", "Remove an unreferenced base now");
  std::string drop_key;
  base_drop->add_option("key", drop_key, "The base's key (from `base list`)")->required();
  auto* daemon_path_cmd = app.add_subcommand(
      "daemon-path",
      "Print the trainstreamd installed beside this trainstreamctl (no daemon needed)");
  CLI11_PARSE(app, argc, argv);
  if (daemon_path_cmd->parsed()) return PrintDaemonPath();

  std::unique_ptr<trainstream::Client> client;
  trainstream::Status s = trainstream::Client::Connect(socket, timeout_ms, &client);
  if (!s.ok()) return Fail(s);

  if (ping_cmd->parsed()) {
    trainstream::PingResult r;
    s = client->Ping(&r);
    if (!s.ok()) return Fail(s);
    std::printf("trainstreamd %s (protocol %u) pid %lld, up %.1f s, at %s\n", r.version.c_str(),
                r.protocol_version, static_cast<long long>(r.pid), r.uptime_s, socket.c_str());
    return 0;
  }
  if (status_cmd->parsed()) {
    std::string doc;
    s = client->StatusJson(&doc);
    if (!s.ok()) return Fail(s);
    if (json) {
      std::printf("%s\n", doc.c_str());
    } else {
      std::printf("%s", trainstream::ctl::RenderStatusTable(nlohmann::json::parse(doc)).c_str());
    }
    return 0;
  }
  if (base_cmd->parsed()) {
    s = trainstream::ctl::RunBaseCommand(*client,
                                         base_load->parsed()   ? "load"
                                         : base_list->parsed() ? "list"
                                                               : "drop",
                                         load_options, drop_key, base_json);
    return s.ok() ? 0 : Fail(s);
  }
  if (shutdown_cmd->parsed()) {
    trainstream::ShutdownResult r;
    s = client->Shutdown(drain           ? trainstream::ShutdownMode::kDrain
                         : discard_state ? trainstream::ShutdownMode::kDiscardState
                                         : trainstream::ShutdownMode::kKeepState,
                         &r);
    if (!s.ok()) return Fail(s);
    if (drain) {
      std::printf(
          "trainstreamd is draining: %u session(s) attached; it exits when the last one detaches\n",
          r.sessions);
    } else if (r.state_kept) {
      std::printf(
          "trainstreamd is stopping with %u session(s) attached: their optimizer state (and "
          "that of adopted sessions still waiting) is kept for the next daemon on this socket, "
          "which adopts it for recovery_grace (%llu s); `shutdown --discard-state` frees it "
          "instead\n",
          r.sessions, static_cast<unsigned long long>(r.recovery_grace_s));
    } else {
      std::printf("trainstreamd is shutting down (%u session(s) were attached)\n", r.sessions);
    }
    return 0;
  }
  return 0;
}
