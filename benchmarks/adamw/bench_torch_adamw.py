#!/usr/bin/env python3
"""Times torch's CPU AdamW (fused where this torch has it, else foreach) and
trainstream-bench-adamw on the same sizes and thread counts, in the same run, and
prints the ratios. Not a test: the figures depend on the machine.

    python benchmarks/adamw/bench_torch_adamw.py --bench build/bin/trainstream-bench-adamw \
        --params 67108864 --tensor-elems 4194304 --threads 1,4,8,16

torch updates fp32 params with fp32 grads and moments (28 B/param); the engine
rows are fp32 grads+moments and bf16 grads+moments, both writing a bf16 weight
copy for the GPU, and the ratio is always against torch's fp32 figure.
"""
import argparse
import json
import subprocess
import sys
import time

import torch

CONFIGS = [  # (grad, moments, weight copy)
    ("fp32", "fp32", "bf16"),
    ("bf16", "bf16", "bf16"),
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
    args = ap.parse_args()

    rows = []
    for threads in [int(t) for t in args.threads.split(",")]:
        kind, torch_gps = time_torch(args.params, args.tensor_elems, threads, args.iters, args.warmup)
        for grad, moments, weight in CONFIGS:
            cmd = [args.bench, "--params", str(args.params), "--tensor-elems", str(args.tensor_elems),
                   "--threads", str(threads), "--grad-dtype", grad, "--moment-dtype", moments,
                   "--param-dtype", weight, "--iters", str(args.iters), "--warmup", str(args.warmup),
                   "--isa", args.isa, "--json"]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            ours = json.loads(out.strip().splitlines()[-1])
            rows.append(dict(threads=threads, torch_kind=kind, torch_gparams_per_s=round(torch_gps, 4),
                             grad_dtype=grad, moment_dtype=moments, param_dtype=weight, isa=ours["isa"],
                             gparams_per_s=ours["gparams_per_s"], gb_per_s=ours["gb_per_s"],
                             ratio_vs_torch=round(ours["gparams_per_s"] / torch_gps, 3)))
    print(f"torch {torch.__version__}, params {args.params}, tensors of {args.tensor_elems}", file=sys.stderr)
    for r in rows:
        if args.json:
            print(json.dumps(r))
        else:
            print(f"threads {r['threads']:2d}  torch {r['torch_kind']:7s} fp32 {r['torch_gparams_per_s']:6.3f} Gparam/s | "
                  f"ours grad {r['grad_dtype']} moments {r['moment_dtype']} ({r['isa']}) "
                  f"{r['gparams_per_s']:6.3f} Gparam/s {r['gb_per_s']:6.1f} GB/s  ratio {r['ratio_vs_torch']:.2f}x")


if __name__ == "__main__":
    main()
