#!/usr/bin/env python3
"""Base-load threads benchmark: how fast trainstreamd reads and quantizes
a checkpoint with 1 loader thread and with N, from the page cache (warm) and from
the disk (cold), next to what the disk gives one `dd` stream and, where
bitsandbytes is importable with a GPU, its NF4 `from_pretrained` of the same files.

    # GPU host: Qwen2.5-14B's shapes (29.5 GB of bf16, 8 shards)
    PYTHONPATH=build/python .venv/bin/python benchmarks/base/bench_load_threads.py \\
        --shape 14b --dir /tmp/ts-bench-14b --reuse --keep
    # CI size, anywhere:
    PYTHONPATH=build/python python benchmarks/base/bench_load_threads.py --tiny

The checkpoint is random bf16 (bench_base_load.write_checkpoint). Warm: every shard
is read once right before the load (the daemon drops the pages it loaded, so each
load needs this), and the share of its pages resident is printed. Cold: each shard
is fsync'ed and dropped with posix_fadvise(DONTNEED) (no root needed for clean
pages), then, if pages stay, `echo 1 > /proc/sys/vm/drop_caches` where permitted.
Each load goes through the daemon's LoadBase with `threads`, and the base is dropped
after it. Output: one `RESULT {json}` line per measurement (also written to --jsonl),
then a table: seconds and GB/s of checkpoint per format, mode and thread count.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from bench_base_load import write_checkpoint  # noqa: E402 (random-weight safetensors)

SHAPES = {  # Qwen2.5 published shapes; "tiny" checks the script
    "14b": dict(layers=48, hidden=5120, intermediate=13824, heads=40, kv_heads=8, vocab=152064),
    "7b": dict(layers=28, hidden=3584, intermediate=18944, heads=28, kv_heads=4, vocab=152064),
    "1.5b": dict(layers=28, hidden=1536, intermediate=8960, heads=12, kv_heads=2, vocab=151936),
    "tiny": dict(layers=2, hidden=256, intermediate=512, heads=4, kv_heads=2, vocab=1000),
}

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def shards(folder):
    return sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".safetensors"))


def resident(files):
    """Share of the files' pages in the page cache (mincore)."""
    pages = held = 0
    for path in files:
        size = os.path.getsize(path)
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = _libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
            n = (size + 4095) // 4096
            vec = ctypes.create_string_buffer(n)
            _libc.mincore(addr, size, vec)
            _libc.munmap(addr, size)
        finally:
            os.close(fd)
        pages += n
        held += n - vec.raw.count(b"\0")
    return held / max(pages, 1)


def make_warm(files):
    buf = bytearray(64 << 20)
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
    return "read", resident(files)


def make_cold(files):
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    method, left = "fadvise", resident(files)
    if left > 0.05:
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1\n")
            method, left = "fadvise+drop_caches", resident(files)
        except OSError:
            pass
    return method, left


def dd_rate(files, cold):
    """GB/s of one sequential `dd` stream over the shards."""
    if cold:
        make_cold(files)
    total, t0 = 0, time.perf_counter()
    for path in files:
        subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=16M"], check=True,
                       capture_output=True)
        total += os.path.getsize(path)
    return total / 1e9 / (time.perf_counter() - t0)


def start_daemon(a, load_threads):
    from trainstream import _control as control
    tmp = tempfile.mkdtemp(prefix="ts-bench-daemon-")
    shm = tempfile.mkdtemp(prefix="ts-bench-shm-", dir="/dev/shm")
    sock = os.path.join(tmp, "d.sock")
    log = open(os.path.join(tmp, "d.log"), "w")
    proc = subprocess.Popen([os.path.join(a.build_dir, "bin", "trainstreamd"), "--foreground",
                             "--socket", sock, "--shm-dir", shm, "--budget", a.budget,
                             "--load-threads", str(load_threads)],
                            stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 30
    while True:
        try:
            return proc, control.Client.connect(sock, 500), sock, [tmp, shm], log
        except control.Unavailable:
            if time.time() > deadline or proc.poll() is not None:
                raise SystemExit(f"trainstreamd did not start: {open(log.name).read()}") from None
            time.sleep(0.1)


BNB = textwrap.dedent("""
    import json, sys, time, torch, transformers
    cfg = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                          bnb_4bit_compute_dtype=torch.bfloat16)
    t0 = time.perf_counter()
    m = transformers.AutoModelForCausalLM.from_pretrained(
        sys.argv[1], quantization_config=cfg, dtype=torch.bfloat16, device_map="cuda:0")
    torch.cuda.synchronize()
    print(json.dumps({"seconds": time.perf_counter() - t0}), flush=True)
""")


def bnb_status():
    try:
        import bitsandbytes  # noqa: F401
        import torch
        import transformers  # noqa: F401
    except ImportError as e:
        return f"not importable ({e.name})"
    return None if torch.cuda.is_available() else "no CUDA GPU (its NF4 quantizes on the GPU)"


def emit(a, row):
    line = json.dumps(row)
    print("RESULT " + line, flush=True)
    if a.jsonl:
        with open(a.jsonl, "a") as f:
            f.write(line + "\n")


def print_table(rows, threads):
    print(f"\n{'format':<7} {'mode':<5} " + " ".join(f"{f'{t} thr s (GB/s)':>18}" for t in threads)
          + "  speedup")
    keys = sorted({(r["format"], r["mode"]) for r in rows if r["kind"] == "trainstream"})
    for fmt, mode in keys:
        best = {}
        for r in rows:
            if r["kind"] == "trainstream" and (r["format"], r["mode"]) == (fmt, mode):
                t = r["threads"]
                best[t] = min(best.get(t, r), r, key=lambda x: x["wall_s"])
        cells = [f"{best[t]['wall_s']:8.2f} ({best[t]['GBps']:5.2f})" if t in best else "-"
                 for t in threads]
        speed = (f"{best[threads[0]]['wall_s'] / best[threads[-1]]['wall_s']:.2f}x"
                 if threads[0] in best and threads[-1] in best else "-")
        print(f"{fmt:<7} {mode:<5} " + " ".join(f"{c:>18}" for c in cells) + f"  {speed}")
    for r in rows:
        if r["kind"] != "trainstream":
            print(f"{r['kind']:<13} {r.get('mode', ''):<5} {r.get('GBps', 0):.2f} GB/s"
                  + (f", {r['wall_s']:.2f} s" if "wall_s" in r else ""))


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="14b", choices=sorted(SHAPES))
    ap.add_argument("--tiny", action="store_true", help="--shape tiny (checks the script)")
    ap.add_argument("--layers", type=int, default=None, help="override the shape's layers")
    ap.add_argument("--shard-gb", type=float, default=4.0)
    ap.add_argument("--threads", default=None,
                    help="comma-separated thread counts (default 1 and the CPUs available)")
    ap.add_argument("--formats", default="none,int8,nf4")
    ap.add_argument("--modes", default="warm,cold", help="warm, cold or both")
    ap.add_argument("--repeat", type=int, default=1, help="loads per case (the best is tabled)")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--dir", default=None, help="checkpoint folder (default: a temp dir, removed)")
    ap.add_argument("--reuse", action="store_true", help="reuse a checkpoint already in --dir")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint folder")
    ap.add_argument("--bnb", default="auto", choices=["auto", "off"],
                    help="bitsandbytes NF4 from_pretrained of the same files (auto: when "
                         "importable with a GPU)")
    ap.add_argument("--budget", default="90%", help="daemon --budget")
    ap.add_argument("--jsonl", default=None, help="also append the JSON lines to this file")
    ap.add_argument("--build-dir", default=os.environ.get("TRAINSTREAM_BUILD_DIR",
                                                           os.path.join(REPO, "build")))
    a = ap.parse_args()
    shape = dict(SHAPES["tiny" if a.tiny else a.shape])
    if a.layers is not None:
        shape["layers"] = a.layers
    if a.tiny:
        a.shard_gb = min(a.shard_gb, 0.002)
    cpus = len(os.sched_getaffinity(0))
    threads = sorted({int(t) for t in (a.threads or f"1,{cpus}").split(",")})
    formats = a.formats.split(",")
    modes = a.modes.split(",")
    for m in modes:
        if m not in ("warm", "cold"):
            raise SystemExit(f"--modes: {m!r} is not warm or cold")

    folder = a.dir or tempfile.mkdtemp(prefix="ts-bench-threads-")
    if a.reuse and os.path.exists(os.path.join(folder, "model.safetensors.index.json")):
        print(f"reusing {folder}", flush=True)
    else:
        write_checkpoint(SimpleNamespace(shard_gb=a.shard_gb, **shape), folder)
    files = shards(folder)
    total = sum(os.path.getsize(f) for f in files)
    base_row = {"shape": a.shape if not a.tiny else "tiny", **shape, "files": len(files),
                "file_bytes": total, "cpus": cpus}
    rows = []
    for mode in modes:
        row = {**base_row, "kind": "dd", "mode": mode, "GBps": round(dd_rate(files, mode == "cold"), 3)}
        rows.append(row)
        emit(a, row)

    proc, client, sock, tmpdirs, log = start_daemon(a, max(threads))
    try:
        for fmt in formats:
            for mode in modes:
                for t in threads:
                    for _ in range(a.repeat):
                        how, held = (make_warm if mode == "warm" else make_cold)(files)
                        t0 = time.perf_counter()
                        info = client.load_base(folder, fmt, a.block_size, None, t)
                        wall = time.perf_counter() - t0
                        client.drop_base(info["key"])
                        row = {**base_row, "kind": "trainstream", "format": fmt, "mode": mode,
                               "threads": t, "load_threads": info["load_threads"],
                               "cache": how, "resident_before": round(held, 3),
                               "wall_s": round(wall, 3), "daemon_s": round(info["load_seconds"], 3),
                               "allocate_s": round(info["allocate_seconds"], 3),
                               "GBps": round(info["source_bytes"] / 1e9 / wall, 3),
                               "source_bytes": info["source_bytes"],
                               "segment_bytes": info["segment_bytes"],
                               "scratch_peak_bytes": info["scratch_peak_bytes"]}
                        rows.append(row)
                        emit(a, row)
                        print(f"  {fmt} {mode} {t} threads: {wall:.2f} s ({row['GBps']:.2f} GB/s; "
                              f"{row['allocate_s']:.2f} s allocating; {held:.0%} of the pages "
                              f"cached before)", flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=120)
        log.close()
        for d in tmpdirs:
            shutil.rmtree(d, ignore_errors=True)

    why = bnb_status() if a.bnb == "auto" else "--bnb off"
    if why is None:
        for mode in modes:
            how, held = (make_warm if mode == "warm" else make_cold)(files)
            r = subprocess.run([sys.executable, "-c", BNB, folder], capture_output=True, text=True)
            if r.returncode != 0:
                print(f"bitsandbytes {mode}: failed: {r.stderr[-2000:]}", flush=True)
                continue
            s = json.loads(r.stdout.strip().splitlines()[-1])["seconds"]
            row = {**base_row, "kind": "bitsandbytes", "format": "nf4", "mode": mode,
                   "wall_s": round(s, 3), "GBps": round(total / 1e9 / s, 3), "cache": how,
                   "resident_before": round(held, 3)}
            rows.append(row)
            emit(a, row)
    else:
        print(f"bitsandbytes: skipped ({why})", flush=True)
    print_table(rows, threads)
    if not a.dir and not a.keep:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
