// trainstreamd's process model (docs/design.md, "Process model"):
//
//   main thread     startup checks, then waits on StopSignals (signals, and
//                   wakes from the handlers; platform/stop_signals.h); it alone
//                   decides when to stop, and runs the shutdown sequence
//   accept thread   ControlListener: accept(), SO_PEERCRED, hand the fd to gRPC
//                   (Linux; on Windows gRPC accepts on loopback TCP itself)
//   gRPC threads    the synchronous server's handlers (ControlService); each
//                   attached session holds one in Attach() for its lifetime
//   pid watcher     pidfd poll: a dead client's session ends at once
//   optimizer       OptimizerService's threads (when built in)
//
// No signal handler runs code: SIGTERM/SIGINT/SIGUSR2 arrive through StopSignals
// (Note [No code in signal handlers], platform/stop_signals.h). A stop with
// sessions attached keeps their state for the next daemon (Note [A restart keeps
// the optimizer state]).
#include "process/daemon.h"

#include <spdlog/spdlog.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "base/base_cache.h"
#include "logging/log_limiter.h"
#include "memory/budget.h"
#include "planes/optimizer_service.h"
#include "process/daemon_state.h"
#include "process/startup_checks.h"
#include "sessions/session_registry.h"
#include "trainstream/human_bytes.h"
#include "trainstream/platform/files.h"
#include "trainstream/platform/process_watcher.h"
#include "trainstream/platform/stop_signals.h"
#include "trainstream/platform/sys_call.h"
#include "trainstream/platform/this_process.h"
#include "trainstream/platform/user.h"
#include "transport/control_listener.h"
#include "transport/control_server.h"
#include "transport/peer_credentials.h"

namespace trainstream::daemon {
namespace {

// Note [Segments outlive a crashed daemon] (shm_segment.h). Runs with the
// socket's lock held: no other daemon of this socket is alive. Reads what the
// previous holder wrote into the lock file, adopts the optimizer state it left
// (Note [Optimizer state outlives the daemon]) and removes the rest of its
// segments (and any of ours in this shm dir), then writes this daemon's
// identity there.
void AdoptReclaimAndClaim(const DaemonConfig& config, SessionRegistry* registry) {
  const std::string tag = SegmentTagFor(config.socket_path);
  const std::string lock_path = config.socket_path + ".lock";
  // The lock file exists (the listener holds it); without it there is nothing
  // to read or to record into.
  std::string previous;
  const int lock_err = platform::ReadFilePrefix(lock_path, 4095, &previous);
  std::string previous_pid = "?", previous_dir;
  // ExitKeepingState marks a stop that left the state on purpose.
  bool previous_kept = false;
  for (size_t at = 0; at < previous.size();) {
    size_t nl = previous.find('\n', at);
    if (nl == std::string::npos) nl = previous.size();
    const std::string line = previous.substr(at, nl - at);
    if (line.rfind("pid=", 0) == 0) previous_pid = line.substr(4);
    if (line.rfind("shm_dir=", 0) == 0) previous_dir = line.substr(8);
    if (line == "kept_state=1") previous_kept = true;
    at = nl + 1;
  }
  const std::string left_by =
      previous_kept ? "that stopped keeping its sessions' state" : "that did not exit cleanly";
  std::vector<std::string> dirs = {config.shm_dir};
  if (!previous_dir.empty() && previous_dir != config.shm_dir) dirs.push_back(previous_dir);
  for (const auto& dir : dirs) {
    const AdoptionStore::Scan a = registry->AdoptPrevious(dir, tag);
    for (const auto& note : a.notes) spdlog::warn("not adopted: {}", note);
    if (a.states != 0) {
      spdlog::warn(
          "adopted the optimizer state of {} sessions ({} segments, {}) in {} left by a "
          "trainstreamd (pid {}) {}: {} parameters' updates finished, "
          "{} journaled sub-chunks completed; each waits {} s for its client to re-attach",
          a.states, a.segments, HumanBytes(a.bytes), dir, previous_pid, left_by, a.rolled_forward,
          a.restored_subchunks, config.recovery_grace_s);
    }
    ReclaimResult r = ReclaimSegments(dir, tag, a.kept);
    if (r.files != 0) {
      spdlog::warn("removed {} segment files ({}) in {} left by a trainstreamd (pid {}) {}{}",
                   r.files, HumanBytes(r.bytes), dir, previous_pid, left_by,
                   r.state_segments == 0
                       ? std::string()
                       : "; the optimizer state of " + std::to_string(r.state_segments) +
                             " sessions in them is lost (load their last state_dict)");
    }
    if (!r.error.empty()) spdlog::warn("reclaiming segments in {}: {}", dir, r.error);
  }
  if (lock_err != 0) return;
  const std::string identity =
      "pid=" + std::to_string(platform::CurrentProcessId()) + "\nshm_dir=" + config.shm_dir +
      "\nstarted_unix_ns=" +
      std::to_string(std::chrono::duration_cast<std::chrono::nanoseconds>(
                         std::chrono::system_clock::now().time_since_epoch())
                         .count()) +
      "\n";
  if (const int err = platform::OverwriteFile(lock_path, identity); err != 0) {
    spdlog::warn("cannot record this daemon in {}: {}", lock_path, platform::ErrnoMessage(err));
  }
}

// Note [A restart keeps the optimizer state]
// A stop keeps what a crash keeps. A package upgrade, `systemctl restart` or `systemctl
// stop` must not lose every job's masters and moments, so a stop request with sessions
// attached (SIGTERM, SIGINT, SIGUSR2, the Windows service's stop, `trainstreamctl
// shutdown`) leaves exactly what a crash leaves: the daemon exits at once, without
// ending a session or unlinking a segment (after a Shutdown call it first stops
// accepting, lets the calls in flight answer, that one's reply among them, and closes
// the session streams without ending the sessions: DaemonState::keeping_state). The
// recovery design already makes any moment of death safe (docs/recovery.md: the redo
// journal, the commit records, roll-forward at adoption), so the next daemon on the
// socket adopts each state for recovery_grace and its clients resume as after a
// SIGKILL; the segments nobody adopts (rings, client regions, bases) are unlinked by
// that daemon's startup sweep. Adopted states still waiting for their client are kept
// the same way (the next daemon adopts them again).
// A clean stop (tell the sessions, end them, free everything) is asked for: by
// `trainstreamctl shutdown --discard-state`, by the end of a drain (`--drain`: no
// session is left, and an adopted state's client could not re-attach while draining),
// and by the idle exit (nothing to keep). It is also what a stop is when nothing can be
// kept: no session and no adopted state, recovery_grace 0 (adoption off), or the
// system shutting down (Windows' kShutdown: no client comes back after it).

// What asked for a stop that keeps the state (for the log), or "" for a clean stop:
// `request` is what ended the main loop's wait (kNone: the loop itself stopped, on
// `rpc_stop`, a drain's end or the idle exit).
std::string WhyKeep(const platform::StopRequest& request, const DaemonState& state, bool rpc_stop,
                    size_t sessions, size_t adopted, uint64_t grace_s) {
  if (request.kind == platform::StopKind::kNone && !rpc_stop) return "";  // drained, idle
  if (state.discard_state.load() || (sessions == 0 && adopted == 0)) return "";
  const std::string what = request.kind == platform::StopKind::kNone
                               ? std::string("Shutdown request")
                               : request.description;
  if (request.kind == platform::StopKind::kShutdown) {
    spdlog::info("{}: the system is going down and no client comes back, so this is a clean stop",
                 what);
    return "";
  }
  if (grace_s == 0) {
    spdlog::info(
        "{} with recovery_grace 0: nothing can be kept for the next daemon, so this is a "
        "clean stop",
        what);
    return "";
  }
  return what;
}

// Note [A restart keeps the optimizer state]. Leaves every session and adopted state
// as it is and exits 0: what is in flight is what a crash at this moment would leave.
// A signal's stop exits at once; a Shutdown call's reply goes out first.
[[noreturn]] void ExitKeepingState(const std::string& why, bool answer_rpc, size_t sessions,
                                   size_t adopted, uint64_t grace_s, const std::string& lock_path,
                                   DaemonState* state, ControlListener* listener,
                                   ControlServer* server) {
  spdlog::info(
      "{}: stopping with {} sessions attached and {} adopted states waiting; their optimizer "
      "state is kept for the next daemon on this socket to adopt (recovery_grace {} s; "
      "`trainstreamctl shutdown --discard-state` is the stop that frees it)",
      why, sessions, adopted, grace_s);
  if (answer_rpc) {
    // The calls in flight answer; then each session's stream is cancelled and its
    // handler returns, leaving the session (DaemonState::keeping_state).
    state->keeping_state.store(true);
    state->shutting_down.store(true);
    listener->Stop();
    server->Shutdown(std::chrono::milliseconds(500));
  }
  // For the next daemon's log (AdoptReclaimAndClaim): this exit was meant.
  if (std::string identity; platform::ReadFilePrefix(lock_path, 4095, &identity) == 0) {
    if (const int err = platform::OverwriteFile(lock_path, identity + "kept_state=1\n"); err != 0)
      spdlog::warn("cannot record the kept state in {}: {}", lock_path,
                   platform::ErrnoMessage(err));
  }
  spdlog::info("trainstreamd stopped, optimizer state kept");
  spdlog::default_logger()->flush();
  std::_Exit(0);
}

}  // namespace

int RunDaemon(const DaemonConfig& cfg_in, platform::StopSignals* stop_signals,
              const std::function<void(const char* error)>& ready) {
  DaemonConfig config = cfg_in;
  auto refuse = [&](const std::string& msg) {
    spdlog::critical("{}", msg);
    ready(msg.c_str());
    return 1;
  };
  if (config.socket_path.empty()) config.socket_path = DefaultDaemonSocket();
  while (config.shm_dir.size() > 1 && config.shm_dir.back() == '/') config.shm_dir.pop_back();

  uint64_t budget_bytes = 0;
  if (auto s = ParseBudget(config.budget, PhysicalRamBytes(), &budget_bytes); !s.ok()) {
    return refuse(s.message());
  }
  AccessPolicy policy;
  if (std::string err; !policy.Resolve(config.allow_group, config.admin_group, &err))
    return refuse(err);

  StartupReport report =
      CheckStartup(GatherStartupFacts(config.shm_dir, budget_bytes, config.lock_memory));
  if (!report.error.empty()) return refuse(report.error);
  for (const auto& w : report.warnings) spdlog::warn("{}", w);

  std::unique_ptr<ControlListener> listener;
  const platform::GroupId socket_gid = policy.has_allow_group() && platform::RunsPrivileged()
                                           ? policy.allow_gid()
                                           : static_cast<platform::GroupId>(-1);
  if (auto s = ControlListener::Bind(config.socket_path, 0660, socket_gid, &listener); !s.ok()) {
    return refuse(s.message());
  }
  // Every segment from here on carries this socket's tag.
  SetSegmentTag(SegmentTagFor(config.socket_path));

  DaemonState state;
  state.socket_path = config.socket_path;
  state.endpoint_secret = listener->secret();  // "" on Linux (control_listener.h)
  state.stop_signals = stop_signals;
  state.Touch();
  Budget budget(budget_bytes);

  auto optimizer = std::make_unique<OptimizerService>(config.threads);
  state.worker_threads = optimizer->worker_threads();

  auto registry = std::make_unique<SessionRegistry>(config, &budget, optimizer.get());
  SessionRegistry* reg = registry.get();
  auto watcher = std::make_unique<platform::ProcessWatcher>([reg, &state](uint64_t id) {
    reg->End(id, "client process exited", true);
    state.Touch();
    state.WakeMainLoop();
  });
  platform::ProcessWatcher* w = watcher.get();
  registry->SetPidHooks([w](uint64_t id, pid_t pid) { return w->Watch(id, pid); },
                        [w](uint64_t id) { w->Unwatch(id); });
  // Before the first connection, with the budget in place.
  AdoptReclaimAndClaim(config, registry.get());

  // Frozen bases: sessions' references drop when they end, and unreferenced
  // bases make room when any reservation would not fit.
  base::BaseCache bases(config, &budget);
  budget.SetReclaimer([&bases](uint64_t missing) { return bases.EvictUnreferenced(missing); });
  registry->AddEndHook([&bases](uint64_t id) { bases.ReleaseSession(id); });

  PeerTable peers;
  std::unique_ptr<ControlServer> server;
  if (auto s = ControlServer::Start(config, listener.get(), &policy, &peers, registry.get(),
                                    &budget, &state, &bases, &server);
      !s.ok()) {
    return refuse(s.message());
  }

  LogLimiter not_allowed_log;
  const uint32_t max_per_uid = config.max_connections_per_uid;
  auto on_accept = [&, max_per_uid](int fd, const PeerCredentials& raw) {
    PeerCredentials creds = raw;
    policy.Apply(&creds);
    // Note [Accepting under a connection flood] (control_listener.h).
    uint32_t live = 0;
    if (!peers.Admit(fd, creds, max_per_uid, &live)) {
      return "uid " + std::to_string(creds.uid) + " already holds " + std::to_string(live) +
             " connections (max_connections_per_uid = " + std::to_string(max_per_uid) + ")";
    }
    // Refused peers still get a channel: their every call is answered with
    // PERMISSION_DENIED (ControlService::Authorize), which tells them why.
    if (uint64_t dropped = 0; !creds.allowed && not_allowed_log.Allow(&dropped)) {
      spdlog::warn("connection from uid {} pid {}: not allowed{}", creds.uid, creds.pid,
                   dropped == 0 ? "" : " (" + std::to_string(dropped) + " more not logged)");
    }
    return std::string();
  };
  if (auto s = server->Accept(listener.get(), on_accept); !s.ok()) return refuse(s.message());
  spdlog::info("trainstreamd {} ready: socket={} shm_dir={} budget={} ({} bytes) workers={} pid={}",
               kDaemonVersion, config.socket_path, config.shm_dir, HumanBytes(budget_bytes),
               budget_bytes, state.worker_threads, platform::CurrentProcessId());
  ready(nullptr);

  std::string why = "shutdown requested";
  platform::StopRequest request;
  for (;;) {
    request = stop_signals->Wait(500);
    if (request.kind == platform::StopKind::kReload) {
      spdlog::info("SIGHUP: nothing to reload (restart the daemon to apply config changes)");
      continue;
    }
    if (request.kind != platform::StopKind::kNone) {
      why = request.description;
      break;
    }
    registry->SweepAdopted();
    if (state.shutdown_requested.load() && !state.draining.load()) break;
    if (state.draining.load() && registry->size() == 0) {
      why = "drained";
      break;
    }
    // An adopted state keeps the daemon up for its client (until its grace ends).
    if (config.idle_exit_s > 0 && registry->size() == 0 && registry->adopted_waiting() == 0) {
      const int64_t idle_ns = std::chrono::steady_clock::now().time_since_epoch().count() -
                              state.last_activity_ns.load();
      if (idle_ns >= static_cast<int64_t>(config.idle_exit_s) * 1000000000LL) {
        why = "idle for " + std::to_string(config.idle_exit_s) + " s";
        break;
      }
    }
  }
  // Note [A restart keeps the optimizer state].
  const bool rpc_stop = request.kind == platform::StopKind::kNone &&
                        state.shutdown_requested.load() && !state.draining.load();
  const size_t attached = registry->size(), adopted = registry->adopted_waiting();
  if (const std::string keep =
          WhyKeep(request, state, rpc_stop, attached, adopted, config.recovery_grace_s);
      !keep.empty()) {
    ExitKeepingState(keep, rpc_stop, attached, adopted, config.recovery_grace_s,
                     config.socket_path + ".lock", &state, listener.get(), server.get());
  }

  // The clean stop: stop accepting, tell the sessions, free everything, exit 0.
  spdlog::info("shutting down ({}): {} sessions attached, {} adopted states freed", why,
               registry->size(), registry->adopted_waiting());
  state.shutting_down.store(true);
  listener->Stop();
  v1::DaemonNotice notice;
  notice.set_kind(v1::DaemonNotice::KIND_SHUTDOWN);
  notice.set_message("daemon shut down: " + why);
  registry->NotifyAll(notice);
  registry->EndAll("daemon shutting down: " + why);
  // Clients that got the notice close their streams; the rest are cancelled.
  server->Shutdown(std::chrono::seconds(2));
  watcher.reset();
  registry.reset();
  optimizer.reset();
  listener->RemoveFiles();
  spdlog::info("trainstreamd stopped");
  return 0;
}

}  // namespace trainstream::daemon
