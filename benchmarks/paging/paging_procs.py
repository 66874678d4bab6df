"""Running bench_paging's cases: each case's own process (its RESULT line, its exit or
its timeout) and the benchmark's private daemon. compare.py, bench_trainer.py,
quality.py and diag_cap.py use these too (through bench_paging, which re-exports them).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def run_case_process(cmd, case: str, timeout: float, stderr_tail: int = 800,
                     on_line=None, env=None) -> dict:
    """Runs one case's process (``cmd``): its last ``RESULT {json}`` line, or an error
    naming its exit status and the end of its stderr, or the timeout; with ``wall_s``.
    ``on_line``: called with each line of the process's stdout as it is printed (the
    case's live records), else stdout is read once the process ends. A result that
    comes from the exit status, not a RESULT line, carries it as ``exit_code``."""
    t0 = time.perf_counter()
    if on_line is None:
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
            lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
            r = json.loads(lines[-1][7:]) if lines else {
                "case": case, "error": f"exit {out.returncode}: {out.stderr[-stderr_tail:]}",
                "exit_code": out.returncode}
        except subprocess.TimeoutExpired:
            r = {"case": case, "error": f"timed out after {timeout} s"}
    else:
        r = _stream_case_process(cmd, case, timeout, stderr_tail, on_line, env)
    r["wall_s"] = round(time.perf_counter() - t0, 1)
    return r


def _stream_case_process(cmd, case, timeout, stderr_tail, on_line, env) -> dict:
    import threading
    with tempfile.TemporaryFile("w+") as err:
        # The caller's process group (no session of its own): a `timeout` around the
        # whole run, which signals its group, ends the case too.
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        results, bad = [], []

        def pump():  # a thread, so the timeout below holds while no line comes
            for line in proc.stdout:
                line = line.rstrip("\n")
                if line.startswith("RESULT "):
                    results.append(line[7:])
                try:
                    on_line(line)
                except Exception as e:  # noqa: BLE001 (one bad line must not stop the reading)
                    bad.append(f"{type(e).__name__}: {e}: {line[:200]}")
        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            proc.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            timed_out = True
        reader.join(timeout=60)  # the pipe closes when the case exits; a bound, not a wait
        err.seek(0)
        tail = err.read()[-stderr_tail:]
    if timed_out:
        return {"case": case, "error": f"timed out after {timeout} s"}
    if results:
        return json.loads(results[-1])
    why = f" (lines its reader could not take: {bad[:3]})" if bad else ""
    return {"case": case, "error": f"exit {proc.returncode}{why}: {tail}",
            "exit_code": proc.returncode}


def start_daemon(budget: str, extra_args=()):
    """A private trainstreamd (the cases need a large shared-memory budget);
    ``extra_args``: more trainstreamd flags (``--daemon-args``, e.g. --recovery-grace 0)."""
    from trainstream._native import daemon as _daemon
    binary = _daemon.daemon_binary() or os.path.join(REPO, "build", "bin", "trainstreamd")
    tmp = tempfile.mkdtemp(prefix="ts-bench-")
    shm = tempfile.mkdtemp(prefix="ts-bench-", dir="/dev/shm")
    sock = os.path.join(tmp, "trainstreamd.sock")
    log = open(os.path.join(tmp, "trainstreamd.log"), "w")
    proc = subprocess.Popen([binary, "--foreground", "--socket", sock, "--shm-dir", shm,
                             "--budget", budget, *extra_args], stdout=log,
                            stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while True:
        try:
            _daemon.connect(sock, spawn=False)
            break
        except Exception:  # noqa: BLE001 (not up yet)
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"trainstreamd did not start; log in {tmp}") from None
            time.sleep(0.1)
    return proc, sock, [tmp, shm]


def stop_daemon(proc, dirs, timeout: float = 30) -> None:
    """Stops what start_daemon started (``proc`` may be None: no daemon of ours) and
    removes ``dirs``."""
    if proc is not None:
        proc.terminate()
        proc.wait(timeout=timeout)
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
