#!/usr/bin/env python3
"""Times torch's CPU AdamW (fused where this torch has it, else foreach) and
trainstream-bench-adamw on the same sizes and thread counts, in the same run, and
prints the ratios. Not a test: the figures depend on the machine.

    python benchmarks/adamw/bench_torch_adamw.py --bench build/bin/trainstream-bench-adamw \
        --params 67108864 --tensor-elems 4194304 --threads 1,4,8,16

torch updates fp32 params with fp32 grads and moments (28 B/param). Engine rows
(eager mode, per-chunk non-finite check, workers pinned), each against torch's
fp32 figure from the same run:
  fp32 like-for-like     fp32 grads+moments, the fp32 param is the master (28 B)
  fp32 + bf16 copy       same, plus a bf16 weight copy for the GPU (30 B)
  bf16 g+m + bf16 copy   bf16 grads and moments, bf16 weight copy (20 B)
  bf16 g+m, split master the same with the master kept as the bf16 copy plus a 16-bit
                         low half, so the copy is not written separately (18 B)
  fp32 l4l exact check   like-for-like with the exact per-parameter check (32 B)

With --roofline BIN (build/bin/trainstream-bench-roofline), also the host's DRAM ceiling
for the fp32 (28 B) and bf16 (20 B) patterns at each thread count, in the same run: the
fastest any engine moving those bytes could go, as a ratio to torch, next to the goals
(1.2x in fp32, 1.6x in bf16).
"""
import argparse
import json
import subprocess
import time

import torch

CONFIGS = [  # (label, grad, moments, weight copy or "master", eager check)
    ("fp32 like-for-like", "fp32", "fp32", "master", "chunk"),
    ("fp32 + bf16 copy", "fp32", "fp32", "bf16", "chunk"),
    ("bf16 g+m + bf16 copy", "bf16", "bf16", "bf16", "chunk"),
    ("bf16 g+m, split master", "bf16", "bf16", "bf16-split", "chunk"),
    ("fp32 l4l exact check", "fp32", "fp32", "master", "param"),
]


def time_torch(params, tensor_elems, threads, iters, warmup):
    torch.set_num_threads(threads)
    sizes = []
    left = params
    while left > 0:
        sizes.append(min(left, tensor_elems))
        left -= sizes[-1]
    ps = [torch.nn.Parameter(torch.randn(n) * 1e-2) for n in sizes]
    for p in ps:
        p.grad = torch.randn_like(p) * 1e-3
    kind = "fused"
    try:
        opt = torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, fused=True)
        opt.step()
    except (RuntimeError, TypeError):
        kind = "foreach"
        opt = torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, foreach=True)
        opt.step()
    for _ in range(warmup):
        opt.step()
    t0 = time.perf_counter()
    for _ in range(iters):
        opt.step()
    seconds = (time.perf_counter() - t0) / iters
    del opt, ps
    return kind, params / seconds / 1e9


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench", default="build/bin/trainstream-bench-adamw")
    ap.add_argument("--params", type=int, default=1 << 26)
    ap.add_argument("--tensor-elems", type=int, default=1 << 22)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--isa", default="auto")
    ap.add_argument("--json", action="store_true", help="one JSON object per row")
    ap.add_argument("--roofline", help="trainstream-bench-roofline binary: print the DRAM ceiling too")
    args = ap.parse_args()

    rows = []
    for threads in [int(t) for t in args.threads.split(",")]:
        kind, torch_gps = time_torch(args.params, args.tensor_elems, threads, args.iters, args.warmup)
        for label, grad, moments, weight, check in CONFIGS:
            cmd = [args.bench, "--check", check, "--params", str(args.params), "--tensor-elems", str(args.tensor_elems),
                   "--threads", str(threads), "--grad-dtype", grad, "--moment-dtype", moments,
                   "--param-dtype", weight, "--iters", str(args.iters), "--warmup", str(args.warmup),
                   "--isa", args.isa, "--json"]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            ours = json.loads(out.strip().splitlines()[-1])
            rows.append(dict(config=label, threads=threads, torch_kind=kind, check=check,
                             torch_gparams_per_s=round(torch_gps, 4),
                             grad_dtype=grad, moment_dtype=moments, param_dtype=weight, isa=ours["isa"],
                             gparams_per_s=ours["gparams_per_s"], gb_per_s=ours["gb_per_s"],
                             bytes_per_param=ours["bytes_per_param"],
                             ratio_vs_torch=round(ours["gparams_per_s"] / torch_gps, 3)))
        if args.roofline:
            rows += ceiling_rows(args, threads, kind, torch_gps)
    if not args.json:
        print(f"torch {torch.__version__}, params {args.params}, tensors of {args.tensor_elems}; "
              f"ratio = ours / torch fused fp32 at the same thread count")
    for r in rows:
        if args.json:
            print(json.dumps(r))
        elif "ceiling_gb_per_s" in r:
            print(f"threads {r['threads']:2d}  ceiling {r['pattern']:11s} {r['ceiling_gb_per_s']:6.1f} GB/s = "
                  f"{r['ceiling_gparams_per_s']:6.3f} Gparam/s at {r['bytes_per_param']} B/param | torch "
                  f"{r['torch_gparams_per_s']:6.3f} | ceiling ratio {r['ceiling_ratio_vs_torch']:.2f}x "
                  f"(goal {r['goal_ratio']}x needs {r['goal_gb_per_s']:.1f} GB/s)")
        else:
            print(f"threads {r['threads']:2d}  {r['config']:23s} ours ({r['isa']}) {r['gparams_per_s']:6.3f} Gparam/s "
                  f"{r['gb_per_s']:6.1f} GB/s ({r['bytes_per_param']:.0f} B/param) | torch {r['torch_kind']} fp32 "
                  f"{r['torch_gparams_per_s']:6.3f} Gparam/s | ratio {r['ratio_vs_torch']:.2f}x")


GOALS = {"adamw-fp32": (28, 1.2), "adamw-bf16": (20, 1.6)}  # pattern: (B/param, goal ratio)


def ceiling_rows(args, threads, kind, torch_gps):
    cmd = [args.roofline, "--elems", str(args.params), "--threads", str(threads), "--patterns",
           ",".join(GOALS), "--iters", str(args.iters), "--warmup", str(args.warmup), "--json"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    rows = []
    for line in out.strip().splitlines():
        r = json.loads(line)
        nbytes, goal = GOALS[r["pattern"]]
        ceiling = r["gb_s"] / nbytes
        rows.append(dict(pattern=r["pattern"], threads=threads, torch_kind=kind,
                         torch_gparams_per_s=round(torch_gps, 4), bytes_per_param=nbytes,
                         ceiling_gb_per_s=r["gb_s"], ceiling_gparams_per_s=round(ceiling, 4),
                         ceiling_ratio_vs_torch=round(ceiling / torch_gps, 3), goal_ratio=goal,
                         goal_gb_per_s=round(goal * torch_gps * nbytes, 1)))
    return rows


if __name__ == "__main__":
    main()
