#!/usr/bin/env python3
"""SIGKILLs trainstreamd (and, with --client-kills, the training client) at random
moments while a client trains, N times, and checks what recovery must guarantee
(docs/recovery.md, "Measured"):

* the run completes and its final weights are bit-identical to an uninterrupted run's
  (same daemon binary, same data, same seed), or, where the client reported a lost
  step, that report names exactly the step it was in when the daemon died (and the
  client then goes on from its last checkpoint, so the weights must still match);
* /dev/shm returns to its baseline at the end.

Each daemon kill lands in a phase the client announces (kill_worker.py): backward,
the daemon's update (step()), state_dict() (checkpoints), a base load; the kill comes
0 to --jitter-ms after the announcement. A supervisor restarts the daemon after 0 to
--restart-ms (as systemd's Restart=on-failure would); with --embedded there is no
supervisor: the client restarts the daemon itself. With --lose-every K, every K-th
kill also deletes the client's staging segment (its gradient pool or slots, and its
weight slots) while no daemon runs, so the state cannot be resumed: the client must
report the lost step. With --in-flight-kills K, the first K daemon kills come from inside
a step instead: the worker waits before that step's backward while the harness pauses
the daemon (SIGSTOP, every thread stopped), runs backward, which posts its gradients to
the paused daemon, and waits again while the harness SIGKILLs it; so each of these kills
finds every gradient of the step posted and none applied, and the resume that follows
must post each of them again (figures: in_flight_kills). --grad-pool sets the client's gradient staging pool
(docs/staging-pool.md; a small one makes backward wait for room, so kills land there).

  kill_loop.py                      20 daemon kills in a 200-step run
  kill_loop.py --short              what `make test` runs (tests/python/test_kill_loop.py)
  kill_loop.py --long               200 daemon kills and 100 client kills
Prints one JSON line of figures at the end; exit code 0 when every check passed.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import random
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
PHASES = ("backward", "step", "state_dict", "base_load")


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=20, help="daemon SIGKILLs")
    ap.add_argument("--client-kills", type=int, default=0, help="client SIGKILLs")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--n-embd", type=int, default=64)
    ap.add_argument("--clip", type=float, default=0.0, help="max_grad_norm (0: eager updates)")
    ap.add_argument("--grad-pool", default="auto",
                    help="the client's gradient staging pool: 'auto', 0 (slots) or bytes (a "
                         "small pool makes backward wait for room, so kills land there too)")
    ap.add_argument("--embedded", action="store_true", help="the client starts the daemon")
    ap.add_argument("--dp", type=int, default=1,
                    help="data-parallel ranks sharing one state (daemon kills only)")
    ap.add_argument("--lose-every", type=int, default=0,
                    help="every K-th daemon kill also deletes the staging segment (0: never)")
    ap.add_argument("--in-flight-kills", type=int, default=0,
                    help="the first K daemon kills come with a step's gradients posted to "
                         "the paused daemon and none applied (SIGKILL, supervised, no "
                         "clipping, one rank, slots or the auto pool, no client kills or "
                         "lost steps)")
    ap.add_argument("--jitter-ms", type=float, default=4.0)
    ap.add_argument("--restart-ms", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--daemon-signal", default="KILL", choices=("KILL", "USR2", "TERM"),
                    help="what ends the daemon: KILL (a crash), USR2 (a restart) or TERM (a "
                         "stop), the last two keeping the state: Note [A restart keeps the "
                         "optimizer state]")
    ap.add_argument("--device", default="cpu",
                    help="where the client's model trains (cpu, cuda: the GPU host's check)")
    ap.add_argument("--optimizer-mode", default="cpu", choices=("cpu", "gpu"),
                    help="with --device cuda: the daemon's host AdamW (cpu) or zero-copy (gpu)")
    ap.add_argument("--short", action="store_true", help="6 kills over 60 steps (CI)")
    ap.add_argument("--long", action="store_true", help="200 daemon kills, 100 client kills")
    ap.add_argument("--build-dir", default=os.environ.get("TRAINSTREAM_BUILD_DIR",
                                                          str(REPO / "build")))
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    a = ap.parse_args(argv)
    if a.lose_every and a.embedded:
        ap.error("--lose-every needs a supervised daemon (it deletes the staging segment "
                 "while none runs); drop --embedded")
    if a.dp > 1 and a.client_kills:
        ap.error("--client-kills with --dp: a killed rank breaks its group by design "
                 "(docs/data-parallel.md); kill the daemon only")
    if a.in_flight_kills and (a.embedded or a.clip or a.dp > 1 or a.client_kills
                              or a.lose_every or a.daemon_signal != "KILL"
                              or str(a.grad_pool) not in ("auto", "0")):
        # A pool smaller than the step's gradients would make backward wait for room
        # that the paused daemon never frees.
        ap.error("--in-flight-kills needs a supervised daemon killed by SIGKILL, eager "
                 "updates (no --clip), one rank, gradient slots or the 'auto' pool, and "
                 "no client kills or lost steps")
    if a.short:
        a.kills, a.steps, a.n_embd = min(a.kills, 6), 60, 32
    if a.long:
        a.kills, a.client_kills, a.steps = 200, 100, 1500
    return a


def _json(text: str):
    """A worker line's JSON, or None for one cut short (its client killed mid-print)."""
    try:
        return json.loads(text)
    except ValueError:
        return None


def trainstream_files(directory: str) -> set:
    try:
        return {n for n in os.listdir(directory) if n.startswith("trainstream-")}
    except FileNotFoundError:
        return set()


def segment_kind(path: str) -> int:
    try:
        with open(path, "rb") as f:
            magic, _version, kind = struct.unpack("<III", f.read(12))
        return kind if magic == 0x54535347 else -1
    except (OSError, struct.error):
        return -1


class Daemon:
    """trainstreamd on a socket, restarted by a supervisor thread after every death
    (explicit mode), or only found (embedded mode: the client starts it)."""

    def __init__(self, args, work: Path, socket: str, shm_dir: str, supervise: bool):
        self.args, self.socket, self.shm_dir = args, socket, shm_dir
        self.binary = str(Path(args.build_dir) / "bin" / "trainstreamd")
        self.log = open(work / f"daemon-{Path(socket).stem}.log", "ab")
        self.proc = None
        self.supervise = supervise
        self.stopping = False
        self.starts = 0
        self.lose_next = False
        self.cv = threading.Condition()
        if supervise:
            self._start()
            self.thread = threading.Thread(target=self._supervise, daemon=True)
            self.thread.start()

    def _start(self):
        self.proc = subprocess.Popen(
            [self.binary, "--foreground", "--socket", self.socket, "--shm-dir", self.shm_dir,
             "--budget", "2G", "--recovery-grace", "60"],
            stdout=self.log, stderr=subprocess.STDOUT)
        self.starts += 1

    def _supervise(self):
        rng = random.Random(self.args.seed * 7 + 1)
        while True:
            self.proc.wait()
            with self.cv:
                if self.stopping:
                    return
                if self.lose_next:
                    # What the daemon that comes back cannot resume: the gradients of
                    # the step in flight went with the staging segment.
                    for name in trainstream_files(self.shm_dir):
                        if segment_kind(os.path.join(self.shm_dir, name)) == 2:
                            os.unlink(os.path.join(self.shm_dir, name))
                    self.lose_next = False
            time.sleep(rng.uniform(0, self.args.restart_ms) / 1000)
            self._start()

    def pid(self):
        if self.supervise:
            return self.proc.pid if self.proc and self.proc.poll() is None else None
        try:
            text = Path(self.socket + ".lock").read_text()
            pid = int(text.split("pid=")[1].split()[0])
            stat = Path(f"/proc/{pid}/stat").read_text()
            # A killed daemon stays a zombie until the client that started it reaps it.
            return None if stat.rsplit(")", 1)[1].split()[0] in ("Z", "X") else pid
        except (OSError, IndexError, ValueError):
            return None

    def pause(self) -> None:
        """SIGSTOPs the running daemon and returns once every one of its threads has
        stopped (a SIGSTOP returns before they all have: Note [A paused daemon is
        stopped in every thread])."""
        deadline = time.monotonic() + 20
        pid = self.pid()
        while pid is None and time.monotonic() < deadline:
            time.sleep(0.005)
            pid = self.pid()
        if pid is None:
            raise SystemExit("no daemon came back to pause")
        os.kill(pid, signal.SIGSTOP)
        while time.monotonic() < deadline:
            states = []
            for tid in os.listdir(f"/proc/{pid}/task"):
                try:
                    stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
                except FileNotFoundError:  # a thread that ended meanwhile
                    continue
                states.append(stat.rsplit(")", 1)[1].split()[0])
            if states and all(st in ("T", "t") for st in states):
                return
            time.sleep(0.001)
        raise SystemExit("the daemon did not stop in every thread in 20 s")

    def kill(self, lose: bool = False) -> bool:
        # The previous kill's daemon may not be back yet: a kill is of a running one
        # (the client may still be resuming: killing that is part of the test).
        deadline = time.monotonic() + 20
        pid = self.pid()
        while pid is None and time.monotonic() < deadline:
            time.sleep(0.005)
            pid = self.pid()
        if pid is None:
            return False
        with self.cv:
            self.lose_next = lose
        os.kill(pid, getattr(signal, "SIG" + self.args.daemon_signal))
        return True

    def stop(self):
        with self.cv:
            self.stopping = True
        if self.supervise and self.proc and self.proc.poll() is None:
            # The clean stop: a SIGTERM would keep a state still waiting for a next daemon.
            ctl = str(Path(self.args.build_dir) / "bin" / "trainstreamctl")
            r = subprocess.run([ctl, "--socket", self.socket, "shutdown", "--discard-state"],
                               capture_output=True, timeout=30)
            if r.returncode != 0 and self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class Worker:
    """kill_worker.py (with --dp, one process per rank, as torchrun would start them:
    RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE and one run id), rank 0's stdout read
    into a queue of (time, words)."""

    runs = 0

    def __init__(self, args, work: Path, socket, env, resume: bool, out: str,
                 in_flight_at=()):
        cmd = [sys.executable, str(HERE / "kill_worker.py"), "--steps", str(args.steps),
               "--n-embd", str(args.n_embd), "--ckpt", str(work / (Path(out).stem + ".ckpt")),
               "--out", out, "--base", str(work / "base.safetensors"), "--timeout-s", "60"]
        if socket:
            cmd += ["--socket", socket]
        if args.clip:
            cmd += ["--clip", str(args.clip)]
        if args.device != "cpu":
            cmd += ["--device", args.device, "--optimizer-mode", args.optimizer_mode]
        cmd += ["--grad-pool", str(args.grad_pool)]
        if resume:
            cmd.append("--resume")
        if in_flight_at:
            cmd += ["--in-flight-at", ",".join(map(str, in_flight_at))]
        Worker.runs += 1
        self.procs = []
        err = open(work / "worker.err", "ab")
        for rank in range(args.dp):
            rank_env = dict(env)
            if args.dp > 1:
                rank_env.update(RANK=str(rank), WORLD_SIZE=str(args.dp), LOCAL_RANK=str(rank),
                                LOCAL_WORLD_SIZE=str(args.dp), OMP_NUM_THREADS="1",
                                TORCHELASTIC_RUN_ID=f"kill-loop-{os.getpid()}-{Worker.runs}")
            self.procs.append(subprocess.Popen(
                cmd + (["--dp"] if args.dp > 1 else []), env=rank_env, text=True, stderr=err,
                stdin=subprocess.PIPE if in_flight_at else None,
                stdout=subprocess.PIPE if rank == 0 else open(work / f"rank{rank}.out", "a")))
        self.proc = self.procs[0]
        self.lines: "queue.Queue" = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put((time.monotonic(), line.split(maxsplit=2)))
        self.lines.put((time.monotonic(), None))

    def go(self) -> None:
        """Lets a worker waiting on the harness (hold, inflight) go on."""
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def wait(self, timeout: float = 180.0) -> int:
        """Every rank's exit; rank 0's code (the others' must match it). A rank still
        running after `timeout` is asked for its stacks (stderr) and killed."""
        codes = []
        for p in self.procs:
            try:
                codes.append(p.wait(timeout))
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGUSR1)
                time.sleep(1)
                p.kill()
                codes.append(p.wait())
        return codes[0] if len(set(codes)) == 1 else max(codes)

    def kill(self):
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()


def write_base(path: Path) -> None:
    """A small safetensors file (one fp32 tensor, 4 MiB): its int8 load takes the
    daemon a few milliseconds."""
    import torch
    t = torch.randn(1024, 1024)
    header = json.dumps({"blocks.0.w": {"dtype": "F32", "shape": [1024, 1024],
                                        "data_offsets": [0, t.numel() * 4]}}).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header + t.numpy().tobytes())


def run_reference(args, work: Path, env) -> str:
    shm = tempfile.mkdtemp(prefix="kill-loop-ref-", dir="/dev/shm")
    socket = str(work / "ref.sock")
    d = Daemon(args, work, socket, shm, supervise=True)
    try:
        w = Worker(args, work, socket, env, resume=False, out=str(work / "reference.pt"))
        if w.wait() != 0:
            raise SystemExit(f"the reference run failed: {(work / 'worker.err').read_text()[-3000:]}")
    finally:
        d.stop()
        shutil.rmtree(shm, ignore_errors=True)
    return str(work / "reference.pt")


def main(argv=None) -> int:
    args = parse(argv)
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="kill-loop-"))
    env = dict(os.environ)
    env.setdefault("TRAINSTREAM_BUILD_DIR", args.build_dir)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(args.build_dir) / "python"),
                                         str(REPO / "tests" / "python"),
                                         env.get("PYTHONPATH", "")])
    baseline = trainstream_files("/dev/shm")
    write_base(work / "base.safetensors")
    t_start = time.monotonic()
    reference = run_reference(args, work, env)

    if args.embedded:
        env["XDG_RUNTIME_DIR"] = str(work / "xdg")
        os.makedirs(env["XDG_RUNTIME_DIR"], mode=0o700)
        env.pop("TRAINSTREAM_SOCKET", None)
        env["TRAINSTREAM_IDLE_EXIT_S"] = "3"
        socket, shm = str(work / "xdg" / "trainstream" / "trainstreamd.sock"), "/dev/shm"
        daemon = Daemon(args, work, socket, shm, supervise=False)
        worker_socket = None
    else:
        shm = tempfile.mkdtemp(prefix="kill-loop-", dir="/dev/shm")
        socket = str(work / "d.sock")
        daemon = Daemon(args, work, socket, shm, supervise=True)
        worker_socket = socket

    # When to kill: daemon kills spread over the run, each in a random phase;
    # client kills in between.
    events = [("daemon", (k + 1) * args.steps / (args.kills + 1)) for k in range(args.kills)]
    events += [("client", (k + 0.5) * args.steps / (args.client_kills + 0.5))
               for k in range(args.client_kills)]
    events.sort(key=lambda e: e[1])
    figures = {"daemon_kills": 0, "client_kills": 0, "by_phase": {p: 0 for p in PHASES},
               "recoveries": 0, "replayed_grads": 0, "landed_grads": 0, "lost_reports": 0,
               "lost_reports_exact": 0, "worker_restarts": 0, "in_flight_kills": 0,
               "resume_s": []}
    failures = []
    out = str(work / "killed.pt")
    # The steps whose gradients the first --in-flight-kills daemon kills find in flight:
    # at or after each event's step, one step apart at least.
    in_flight_at = []
    for kind, at_step in events:
        if kind == "daemon" and len(in_flight_at) < args.in_flight_kills:
            in_flight_at.append(max(int(at_step) + 1, in_flight_at[-1] + 1 if in_flight_at else 1))
    worker = Worker(args, work, worker_socket, env, resume=False, out=out,
                    in_flight_at=in_flight_at)
    in_flight = {}  # the in-flight kill whose resume is still to come: step, gradients posted
    last_phase = (None, 0)
    kill_times = []
    daemon_kills_done = 0
    done = False

    def handle(words):
        nonlocal last_phase, done
        if words[0] == "phase":
            last_phase = (words[1], int(words[2]))
        elif words[0] == "resumed":
            info = _json(words[2])
            if info is None:
                return
            figures["recoveries"] += 1
            figures["replayed_grads"] += info["replayed"]
            figures["landed_grads"] += info["landed"]
            if in_flight:
                # The daemon was paused before the step's backward and killed after it:
                # none of the step's gradients landed, every one is posted again.
                if (int(words[1]) == in_flight["step"] and info["landed"] == 0
                        and info["replayed"] == in_flight["posted"] > 0):
                    figures["in_flight_kills"] += 1
                else:
                    failures.append(f"the kill in step {in_flight['step']} with "
                                    f"{in_flight['posted']} gradients posted and none applied "
                                    f"was resumed in step {words[1]} with {info}")
                in_flight.clear()
            if kill_times:
                figures["resume_s"].append(time.monotonic() - kill_times[-1])
        elif words[0] == "lost":
            step, lost = int(words[1]), _json(words[2])
            if lost is None:
                return
            message = lost["message"]
            figures["lost_reports"] += 1
            # The client cannot finish a step without a daemon: the step it reports
            # must be the one it was in (its last phase), named in the message (as its
            # optimizer counts steps: from the checkpoint this worker started from).
            if step == last_phase[1] and f"step {lost['optimizer_step']} " in message:
                figures["lost_reports_exact"] += 1
            else:
                failures.append(f"lost report names step {step}, the client was in step "
                                f"{last_phase[1]} ({last_phase[0]}): {message}")
        elif words[0] == "done":
            done = True

    def pump(until=None, timeout=120.0):
        """Reads the worker's lines until `until(words)` or its exit; returns the words or
        None (exited)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                _, words = worker.lines.get(timeout=1.0)
            except queue.Empty:
                continue
            if words is None:
                return None
            # A line cut short (a client killed while it printed) or another library's
            # output on stdout: only whole lines of the worker's protocol count.
            if not words or (words[0] in ("phase", "resumed", "lost") and len(words) < 3):
                continue
            handle(words)
            if until is not None and until(words):
                return words
        raise SystemExit(f"the worker said nothing for {timeout} s; see {work}")

    def restart_worker():
        nonlocal worker
        figures["worker_restarts"] += 1
        worker = Worker(args, work, worker_socket, env, resume=True, out=out)

    def exited_for_good() -> bool:
        """After the worker exited: True if it finished or failed (recorded); False if
        it lost its state (code 3) and was restarted from its checkpoint."""
        code = worker.wait()
        if code == 0 or done:
            return True
        if code != 3:
            failures.append(f"the worker exited with {code}: "
                            f"{(work / 'worker.err').read_text()[-3000:]}")
            return True
        restart_worker()
        return False

    pending = list(events)
    while pending and not done:
        kind, at_step = pending[0]
        if kind == "daemon" and daemon_kills_done < len(in_flight_at):
            pending.pop(0)
            step = in_flight_at[daemon_kills_done]
            daemon_kills_done += 1
            if pump(lambda w, s=step: w[0] == "hold" and int(w[1]) == s) is None:
                failures.append(f"the worker exited before step {step}'s backward")
                break
            daemon.pause()
            worker.go()
            words = pump(lambda w, s=step: w[0] == "inflight" and int(w[1]) == s)
            if words is None:
                failures.append(f"the worker exited in step {step}'s backward")
                break
            if not daemon.kill():
                raise SystemExit("the paused daemon was gone before its kill")
            kill_times.append(time.monotonic())
            figures["daemon_kills"] += 1
            figures["by_phase"]["backward"] += 1
            in_flight.update(step=step, posted=json.loads(words[2])["posted"])
            worker.go()
            continue
        # At least one step after the last kill: every event gets a moment of its own.
        at_step = max(at_step, last_phase[1] + 1)
        target_phase = rng.choice(PHASES) if kind == "daemon" else rng.choice(PHASES[:3])
        if target_phase == "base_load":
            # kill_worker.py loads the base before step i + 1 when i % 25 == 12; a load
            # further off than the next event would push every later kill back.
            spacing = args.steps / (len(events) + 1)
            base_steps = [i + 1 for i in range(args.steps)
                          if i % 25 == 12 and at_step <= i + 1 <= at_step + max(spacing, 1)]
            if base_steps:
                at_step = base_steps[0]
            else:
                target_phase = rng.choice(PHASES[:3])
        words = pump(lambda w, at=at_step, phase=target_phase:
                     w[0] == "phase" and int(w[2]) >= at and w[1] == phase)
        if words is None:  # the worker exited: finished, or lost its state (code 3)
            if exited_for_good():
                break
            continue  # the same event, in the restarted worker
        pending.pop(0)
        time.sleep(rng.uniform(0, args.jitter_ms) / 1000)
        if kind == "daemon":
            daemon_kills_done += 1
            lose = args.lose_every > 0 and daemon_kills_done % args.lose_every == 0
            if daemon.kill(lose=lose):
                kill_times.append(time.monotonic())
                figures["daemon_kills"] += 1
                figures["by_phase"][target_phase] += 1
        else:
            worker.kill()
            figures["client_kills"] += 1
            pump(timeout=10)  # what it said before dying
            restart_worker()
    # Let it finish, restarting it whenever its state was lost.
    while not done:
        if pump() is None and exited_for_good():
            break
    worker.wait()

    import torch
    if done:
        ref, got = torch.load(reference), torch.load(out)
        differ = [k for k in ref if not torch.equal(ref[k], got[k])]
        if differ:
            failures.append(f"{len(differ)} tensors differ from the uninterrupted run: "
                            f"{differ[:5]}")
        for rank in range(1, args.dp):  # every rank holds the group's weights
            other = torch.load(out.replace(".pt", f"-rank{rank}.pt"))
            if any(not torch.equal(got[k], other[k]) for k in got):
                failures.append(f"rank {rank}'s weights differ from rank 0's")
    else:
        failures.append("the run did not complete")
    daemon.stop()
    if args.daemon_signal in ("USR2", "TERM") and not args.embedded:
        # Each stop must have been the daemon's own exit keeping the state (Note [A
        # restart keeps the optimizer state]), not the signal's default action, which
        # would leave the same state.
        log = (work / f"daemon-{Path(socket).stem}.log").read_text(errors="replace")
        figures["restart_exits"] = log.count(
            "optimizer state is kept for the next daemon on this socket")
        if figures["restart_exits"] < figures["daemon_kills"]:
            failures.append(f"{figures['daemon_kills']} SIG{args.daemon_signal} sent, but the "
                            f"daemon's log shows {figures['restart_exits']} exits keeping the "
                            "state")
    # /dev/shm back to its baseline: nothing of ours is left (an embedded daemon exits
    # once idle; a killed client's adopted state goes when the daemon sees it is gone).
    deadline = time.monotonic() + 15
    ours = shm if not args.embedded else "/dev/shm"
    while time.monotonic() < deadline and (trainstream_files(ours) - baseline
                                           or trainstream_files("/dev/shm") - baseline):
        time.sleep(0.1)
    left = (trainstream_files(ours) | trainstream_files("/dev/shm")) - baseline
    if left:
        failures.append(f"segments left behind: {sorted(left)[:5]} ({len(left)})")
    if not args.embedded:
        shutil.rmtree(shm, ignore_errors=True)
    planned = (args.kills, args.client_kills)
    if in_flight:
        failures.append(f"the kill in step {in_flight['step']} was never resumed")
    if figures["in_flight_kills"] != len(in_flight_at) and not failures:
        failures.append(f"{figures['in_flight_kills']} of {len(in_flight_at)} kills found "
                        "their step's gradients in flight")
    if (figures["daemon_kills"], figures["client_kills"]) != planned and not failures:
        failures.append(f"only {figures['daemon_kills']} daemon and {figures['client_kills']} "
                        f"client kills of {planned} happened before the run ended: give it "
                        "more --steps")
    resume = figures.pop("resume_s")
    figures.update(
        steps=args.steps, mode="embedded" if args.embedded else "supervised",
        signal=args.daemon_signal, clip=args.clip, ranks=args.dp,
        daemon_starts=daemon.starts if not args.embedded else None,
        resume_s_median=round(statistics.median(resume), 3) if resume else None,
        resume_s_max=round(max(resume), 3) if resume else None,
        seconds=round(time.monotonic() - t_start, 1), bit_identical=done and not any(
            "differ" in f for f in failures), failures=failures, work=str(work))
    print(json.dumps(figures), flush=True)
    if not failures and not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
