"""How long a client's ftruncate of its own segment takes to end its session, and what
it costs everyone else (Note [Client pages can vanish], daemon/memory/client_memory_guard.h).

Starts a daemon on a temporary socket, and N times: attaches an attacker
(trainstream-test-client), truncates its control segment, and times until the
client's session is reported ended. Prints min/median/max, and the daemon's RSS
before and after. Usage:
  python benchmarks/security/truncate_latency.py [--build build] [--n 20]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def rss(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--n", type=int, default=20)
    a = ap.parse_args()
    bin_dir = Path(a.build).resolve() / "bin"
    tmp = tempfile.mkdtemp(prefix="tsd-bench-")
    shm = tempfile.mkdtemp(prefix="tsd-bench-shm-", dir="/dev/shm")
    sock = os.path.join(tmp, "s.sock")
    d = subprocess.Popen([str(bin_dir / "trainstreamd"), "--foreground", "--socket", sock,
                          "--shm-dir", shm, "--budget", "1G"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(500):
            if subprocess.run([str(bin_dir / "trainstreamctl"), "--socket", sock, "ping"],
                              capture_output=True).returncode == 0:
                break
            time.sleep(0.02)
        rss0 = rss(d.pid)
        times = []
        for _ in range(a.n):
            c = subprocess.Popen([str(bin_dir / "trainstream-test-client"), "--socket", sock],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

            def send(cmd):
                c.stdin.write(cmd + "\n")
                c.stdin.flush()
                return json.loads(c.stdout.readline())

            seg = send("attach bench 0")["control"]["segment"]
            t0 = time.perf_counter()
            assert send(f"truncate {seg} 0")["ok"]
            r = send("wait_dead 10000")
            times.append(time.perf_counter() - t0)
            assert not r["alive"] and "truncated" in r["why"], r
            c.stdin.write("quit\n")
            c.stdin.close()
            c.wait()
        assert d.poll() is None, "the daemon died"
        ms = sorted(t * 1e3 for t in times)
        print(f"ftruncate of the control segment -> session ended, {a.n} runs: "
              f"min {ms[0]:.1f} ms, median {statistics.median(ms):.1f} ms, max {ms[-1]:.1f} ms")
        print(f"daemon RSS {rss0 / 2**20:.1f} MiB before, {rss(d.pid) / 2**20:.1f} MiB after; "
              f"daemon alive: {d.poll() is None}")
    finally:
        d.terminate()
        d.wait()
        os.rmdir(shm) if not os.listdir(shm) else None


if __name__ == "__main__":
    sys.exit(main())
