"""Data parallel on one machine (docs/data-parallel.md): step time and host RAM for

  1 rank                        (one process, one optimizer state)
  N ranks, shared state         (default: one group, one state, gradients summed in shm)
  N ranks, per-rank copies      (TRAINSTREAM_SHM=0: one session and state per rank,
                                 gradients all-reduced with torch.distributed first)

Starts its own trainstreamd on a temporary socket, launches each configuration with
torchrun, and prints one JSON line per configuration plus a table. Host RAM is the
daemon's resident memory (VmRSS, of which RssShmem is shared memory it touched), the
bytes of every shared-memory segment (`trainstreamctl status --json`), and the ranks'
private resident memory (RssAnon, summed).

    python benchmarks/dp/bench_dp.py --ranks 2            # GPU host: one GPU per rank
    python benchmarks/dp/bench_dp.py --ranks 2 --small    # CPU check of the script
    python benchmarks/dp/bench_dp.py --nodes 2 --ranks 1  # 2 "machines" x 1 GPU: gloo vs NCCL

A GPT-style model (TinyGPT from tests/python, scaled by --n-embd/--n-layer/--vocab) is
trained on random tokens; --small shrinks it for CPU machines.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(REPO, "tests", "python"))


def _proc_status(pid) -> dict:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "RssAnon", "RssShmem"):
                out[k] = int(v.split()[0]) * 1024
    return out


def worker(args) -> int:
    import torch
    import torch.distributed as dist

    import trainstream
    from tiny_gpt import GPTConfig, TinyGPT
    from trainstream._native import daemon as _daemon

    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    if world > 1:
        dist.init_process_group("nccl" if cuda and not args.gloo else "gloo")
    dev = torch.device(f"cuda:{local_rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(dev)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.n_layer,
                    n_head=args.n_head, n_embd=args.n_embd)
    model = TinyGPT(cfg).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    t0 = time.perf_counter()
    # The daemon's host AdamW in every configuration (one rank would otherwise pick the
    # GPU mode, then torch's AdamW once it fits), so the three compare like for like.
    model, opt = trainstream.wrap(model, opt, timeout_s=300, offload=True, optimizer_mode="cpu")
    wrap_s = time.perf_counter() - t0
    g = torch.Generator(device=dev).manual_seed(1 + int(os.environ.get("RANK", "0")))
    times = []
    for step in range(args.warmup + args.steps):
        x = torch.randint(cfg.vocab_size, (args.batch, args.seq), device=dev, generator=g)
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
            loss = model(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if cuda:
            torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - t)
    if world > 1:
        dist.barrier()  # every rank attached while memory is read
    mine = _proc_status("self")
    ranks_anon = torch.tensor([mine.get("RssAnon", 0)], dtype=torch.float64, device=dev)
    if world > 1:
        dist.all_reduce(ranks_anon)
    if local_rank == 0:
        status = json.loads(_daemon.connect(None, spawn=False).status_json())
        daemon = _proc_status(status["pid"])
        print("RESULT " + json.dumps({
            "ranks": world,
            "mode": os.environ.get("BENCH_MODE", ""),
            "params": sum(p.numel() for p in model.parameters()),
            "wrap_s": round(wrap_s, 3),
            "step_s_median": round(statistics.median(times), 5),
            "step_s_min": round(min(times), 5),
            "daemon_rss": daemon.get("VmRSS", 0),
            "daemon_rss_shmem": daemon.get("RssShmem", 0),
            "shm_bytes": sum(s["bytes"] for s in status["segments"]),
            "state_bytes": status["segments_by_kind"]["state"]["bytes"],
            "ranks_rss_anon": int(ranks_anon.item()),
            "allreduce_s": (opt.stats()["data_parallel"] or {}).get("allreduce_s", 0.0),
        }), flush=True)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Daemon:
    """A trainstreamd on a temporary socket and shm directory (one per simulated machine)."""

    def __init__(self, budget: str):
        from trainstream._native import daemon as _daemon
        binary = _daemon.daemon_binary()
        if binary is None:
            sys.exit("trainstreamd not found: build first or set TRAINSTREAM_DAEMON")
        self.tmp = tempfile.mkdtemp(prefix="bench-dp-")
        self.socket = os.path.join(self.tmp, "trainstreamd.sock")
        self.shm = tempfile.mkdtemp(prefix="bench-dp-shm-", dir="/dev/shm")
        self.log = open(os.path.join(self.tmp, "trainstreamd.log"), "w")
        self.proc = subprocess.Popen([binary, "--foreground", "--socket", self.socket,
                                      "--shm-dir", self.shm, "--budget", budget],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while not os.path.exists(self.socket):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                sys.exit(f"trainstreamd did not start; log: {self.log.name}")
            time.sleep(0.05)

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()
        shutil.rmtree(self.shm, ignore_errors=True)


def _result(name: str, stdout: str, stderr: str, code: int):
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    if code != 0 or not lines:
        print(f"{name}: failed (exit {code})\n{stdout}\n{stderr}")
        return None
    r = json.loads(lines[0][len("RESULT "):])
    r["config"] = name
    print(json.dumps(r), flush=True)
    return r


def launch_nodes(args) -> int:
    """--nodes N: N simulated machines on this host (a daemon and a torchrun each, node k
    on GPUs k*ranks ..), once with gloo and once with NCCL for the cross-machine
    all-reduce of the machine sums (TRAINSTREAM_DP_REDUCE)."""
    import torch
    cuda = torch.cuda.device_count() >= args.nodes * args.ranks
    passthrough = [a for a in sys.argv[1:] if a != "--worker"]
    results = []
    for backend in ("gloo", "nccl") if cuda else ("gloo",):
        daemons = [Daemon(args.budget) for _ in range(args.nodes)]
        port = _free_port()
        procs = []
        try:
            for k, d in enumerate(daemons):
                env = dict(os.environ, TRAINSTREAM_SOCKET=d.socket, TRAINSTREAM_DP_REDUCE=backend,
                           BENCH_MODE=f"{args.nodes} machines, {backend}")
                env.setdefault("OMP_NUM_THREADS", "1")
                if cuda:
                    env["CUDA_VISIBLE_DEVICES"] = ",".join(
                        str(k * args.ranks + i) for i in range(args.ranks))
                cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(args.nodes),
                       "--node-rank", str(k), "--master-addr", "127.0.0.1", "--master-port",
                       str(port), "--nproc-per-node", str(args.ranks), os.path.abspath(__file__),
                       "--worker", *passthrough]
                procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                              stderr=subprocess.PIPE, text=True))
            outs = [p.communicate(timeout=args.timeout_s) for p in procs]
            r = _result(f"{args.nodes} machines x {args.ranks} ranks, all-reduce via {backend}",
                        outs[0][0], outs[0][1], procs[0].returncode)
            if r is None:
                return 1
            results.append(r)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            for d in daemons:
                d.stop()
    for r in results:
        print(f"{r['config']:50s} step {r['step_s_median']:.4f} s, all-reduce "
              f"{r['allreduce_s']:.3f} s in total")
    return 0


def launcher(args) -> int:
    if args.nodes > 1:
        return launch_nodes(args)
    daemon = Daemon(args.budget)
    sock = daemon.socket
    results = []
    try:
        configs = [("1 rank", 1, {}), (f"{args.ranks} ranks, shared state", args.ranks, {}),
                   (f"{args.ranks} ranks, per-rank copies (TRAINSTREAM_SHM=0)", args.ranks,
                    {"TRAINSTREAM_SHM": "0"})]
        passthrough = [a for a in sys.argv[1:] if a != "--worker"]
        for name, n, extra in configs:
            env = dict(os.environ, TRAINSTREAM_SOCKET=sock, BENCH_MODE=name, **extra)
            env.setdefault("OMP_NUM_THREADS", "1")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", str(n), os.path.abspath(__file__), "--worker",
                   *passthrough]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                 timeout=args.timeout_s)
            r = _result(name, out.stdout, out.stderr, out.returncode)
            if r is None:
                return 1
            results.append(r)
    finally:
        daemon.stop()
    def human(b):
        return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.1f} MiB"
    print(f"\nmodel: {results[0]['params'] / 1e6:.1f} M parameters; "
          f"step = forward + backward + optimizer.step() per rank, median of {args.steps}")
    print(f"{'configuration':50s} {'step s':>8s} {'daemon RSS':>11s} {'shm':>11s} "
          f"{'state':>11s} {'ranks anon':>11s}")
    for r in results:
        print(f"{r['config']:50s} {r['step_s_median']:8.4f} {human(r['daemon_rss']):>11s} "
              f"{human(r['shm_bytes']):>11s} {human(r['state_bytes']):>11s} "
              f"{human(r['ranks_rss_anon']):>11s}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--nodes", type=int, default=1,
                    help="simulate this many machines (a daemon each); compares gloo and NCCL "
                         "for the cross-machine all-reduce")
    ap.add_argument("--small", action="store_true", help="a small model for CPU checks")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--n-embd", type=int, default=1536)
    ap.add_argument("--n-layer", type=int, default=12)
    ap.add_argument("--n-head", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--gloo", action="store_true", help="gloo even with CUDA (default nccl)")
    ap.add_argument("--budget", default="50%")
    ap.add_argument("--timeout-s", type=float, default=600)
    args = ap.parse_args()
    if args.small:
        args.seq, args.n_embd, args.n_layer, args.n_head, args.vocab, args.batch = \
            64, 64, 2, 4, 512, 4
    return worker(args) if args.worker else launcher(args)


if __name__ == "__main__":
    sys.exit(main())
