#!/usr/bin/env python3
"""How long trainstreamd takes to load a checkpoint whose header lists many
tensors (docs/base-cache.md, "Bad input": the header parse used to be quadratic).

Writes one .safetensors file per count N: N - 1 empty U8 tensors and one
4-byte F32 tensor (the shape of a crafted header), starts the daemon of
--build-dir on a private socket, loads each file with `trainstreamctl base load`
and prints the wall time of the load and the CPU time the daemon spent on it
(utime + stime from /proc/<pid>/stat).

    python3 benchmarks/safetensors_header.py --build-dir build-st
    python3 benchmarks/safetensors_header.py --build-dir build --counts 32768 65536

Needs only the trainstreamd and trainstreamctl binaries (no torch). Counts
above the daemon's tensor cap (kMaxTensors, daemon/base/safetensors.h) are
reported as refused, with the time the refusal took.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TICKS = os.sysconf("SC_CLK_TCK")


def write_header_file(path: str, count: int) -> int:
    parts = [f'"t{i}":{{"dtype":"U8","shape":[0],"data_offsets":[0,0]}}' for i in range(count - 1)]
    parts.append('"last":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}')
    header = ("{" + ",".join(parts) + "}").encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        f.write(b"\0" * 4)
    return len(header)


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build-dir", default=os.environ.get("TRAINSTREAM_BUILD_DIR",
                                                          os.path.join(REPO, "build")))
    ap.add_argument("--counts", type=int, nargs="+", default=[32768, 65536, 200000])
    args = ap.parse_args()
    bin_dir = os.path.join(os.path.abspath(args.build_dir), "bin")
    for b in ("trainstreamd", "trainstreamctl"):
        if not os.path.exists(os.path.join(bin_dir, b)):
            sys.exit(f"{bin_dir}/{b} is missing: build it first")

    tmp = tempfile.mkdtemp(prefix="ts-hdr-bench-")
    shm = tempfile.mkdtemp(prefix="ts-hdr-bench-", dir="/dev/shm")
    sock = os.path.join(tmp, "d.sock")
    log = open(os.path.join(tmp, "d.log"), "w")
    daemon = subprocess.Popen([os.path.join(bin_dir, "trainstreamd"), "--foreground", "--socket",
                               sock, "--shm-dir", shm, "--budget", "1G", "--log-level", "warn"],
                              stdout=log, stderr=subprocess.STDOUT)

    def ctl(*a):
        return subprocess.run([os.path.join(bin_dir, "trainstreamctl"), "--socket", sock,
                               "--timeout-ms", "2000", *a], capture_output=True, text=True)

    try:
        deadline = time.monotonic() + 30
        while ctl("ping").returncode != 0:
            if daemon.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"trainstreamd did not start; log in {log.name}")
            time.sleep(0.05)
        print(f"daemon: {bin_dir}/trainstreamd")
        print(f"{'tensors':>8} {'header bytes':>13} {'load wall s':>12} {'daemon cpu s':>13}  result")
        for count in args.counts:
            path = os.path.join(tmp, f"h{count}.safetensors")
            nbytes = write_header_file(path, count)
            cpu0, t0 = cpu_seconds(daemon.pid), time.monotonic()
            r = ctl("base", "load", path, "--json")
            wall, cpu = time.monotonic() - t0, cpu_seconds(daemon.pid) - cpu0
            if r.returncode == 0:
                key = json.loads(r.stdout)["key"]
                ctl("base", "drop", key)
                result = "loaded"
            else:
                result = "refused: " + r.stderr.strip().splitlines()[-1][:120]
            print(f"{count:>8} {nbytes:>13} {wall:>12.3f} {cpu:>13.2f}  {result}", flush=True)
            os.unlink(path)
    finally:
        daemon.terminate()
        try:
            daemon.wait(timeout=30)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
