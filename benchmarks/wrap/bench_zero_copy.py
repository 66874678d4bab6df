"""The zero-copy CUDA AdamW (optimizer_mode="gpu") alone: Gparam/s and PCIe GB/s of
the kernel over moments in pinned host memory, against copies of the same bytes
(H2D and D2H at once, on two streams) in the same run.

    PYTHONPATH=build/python python benchmarks/wrap/bench_zero_copy.py [--numel 67108864]

Needs a CUDA build of trainstream._C (GPU host).
"""
from __future__ import annotations

import argparse
import json
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--numel", type=int, default=1 << 26)
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    import torch
    from trainstream import _C
    if not torch.cuda.is_available() or not getattr(_C, "has_adamw_cuda", False):
        print("needs CUDA and a CUDA build of trainstream._C", file=sys.stderr)
        return 2
    n = args.numel
    dev = torch.device("cuda")
    param = torch.randn(n, device=dev)
    grad = torch.randn(n, device=dev)
    results = []
    for moment in ("float32", "bfloat16"):
        dt = torch.float32 if moment == "float32" else torch.bfloat16
        m = torch.zeros(n, dtype=dt, pin_memory=True)
        v = torch.zeros(n, dtype=dt, pin_memory=True)
        dm = _C.host_device_address(m.data_ptr())
        dv = _C.host_device_address(v.data_ptr())

        def step(k):
            _C.adamw_cuda_step(param, grad, 0, dm, dv, moment, k, 1e-3, 0.9, 0.999, 1e-8, 0.01)
        step(1)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for k in range(args.iters):
            step(k + 2)
        torch.cuda.synchronize()
        t = (time.perf_counter() - t0) / args.iters
        moved = 4 * n * m.element_size()  # read and write both moments
        # The same bytes as plain copies: both moments H2D and D2H at once.
        dm_dev = torch.empty(2 * n, dtype=dt, device=dev)
        host_back = torch.empty(2 * n, dtype=dt, pin_memory=True)
        host_src = torch.cat([m, v]).pin_memory()
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        for _ in range(args.iters):
            with torch.cuda.stream(s1):
                dm_dev.copy_(host_src, non_blocking=True)
            with torch.cuda.stream(s2):
                host_back.copy_(dm_dev, non_blocking=True)
        torch.cuda.synchronize()
        tc = (time.perf_counter() - t1) / args.iters
        r = {"moment_dtype": moment, "numel": n, "kernel_s": t,
             "gparams_per_s": n / t / 1e9, "pcie_gb_s": moved / t / 1e9,
             "copy_same_bytes_s": tc, "kernel_vs_copies": t / tc}
        results.append(r)
        print(json.dumps(r), flush=True)
    for r in results:
        print(f"{r['moment_dtype']:>9} moments: {r['gparams_per_s']:.2f} Gparam/s, "
              f"{r['pcie_gb_s']:.1f} GB/s over PCIe (read+write); plain copies of the same "
              f"bytes {r['copy_same_bytes_s'] * 1e3:.1f} ms, kernel {r['kernel_s'] * 1e3:.1f} ms "
              f"= {r['kernel_vs_copies']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
