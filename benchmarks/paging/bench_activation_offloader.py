"""The standalone ActivationOffloader on a GPU, against the same model without it.

    python benchmarks/paging/bench_activation_offloader.py [--layers 8 --d-model 2048 ...]

One process, one model. It runs: no offloader (the reference), offload=True (every block
pages), offload="auto" (the step-time search) and recompute=True. For each it prints the
median step time and peak VRAM as ratios against the reference, checks that the
gradients match the reference's exactly, and checks that transfer_stats("cuda") grew by
exactly the bytes the offloader paged. It also prints profile_hardware(force=True)
.summary(), memory_report()["pinned_by_tag"] while pages are live, and the auto
search's decision. Needs CUDA; it does not need the daemon or trainstream._C.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import torch
from torch import nn

import trainstream


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class Model(nn.Module):
    def __init__(self, layers: int, d: int, heads: int):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x).float().pow(2).mean()


def _run(model, x, steps):
    times = []
    torch.cuda.reset_peak_memory_stats()
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        model(x).backward()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:]), torch.cuda.max_memory_allocated()


def _grads(model):
    return [p.grad.detach().clone() for p in model.parameters()]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 2
    # The math attention kernel: its backward is deterministic, so "exact" can be exact.
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.backends.cuda.enable_cudnn_sdp(False)
    print(trainstream.profile_hardware(force=True).summary(print_it=False))
    torch.manual_seed(0)
    ref = Model(args.layers, args.d_model, args.heads).cuda()
    x = torch.randn(args.batch, args.seq, args.d_model, device="cuda")
    ref_s, ref_peak = _run(ref, x, args.steps)
    ref_grads = _grads(ref)
    print(f"reference: {ref_s * 1e3:.1f} ms/step, peak {ref_peak / 2**30:.2f} GiB")
    failures = 0
    cases = [("offload=True", dict(offload=True)),
             ("offload='auto'", dict(offload="auto", calibrate_steps=3, tune_window=3)),
             ("recompute=True", dict(offload=False, recompute=True))]
    for name, kwargs in cases:
        model = copy.deepcopy(ref)
        steps = args.steps if kwargs.get("offload") != "auto" else max(args.steps, 40)
        before = trainstream.transfer_stats("cuda")
        off = trainstream.ActivationOffloader(model, model.blocks, **kwargs)
        s, peak = _run(model, x, steps)
        after = trainstream.transfer_stats("cuda")
        tags = trainstream.memory_report()["pinned_by_tag"]
        exact = all(torch.equal(a, b) for a, b in zip(ref_grads, _grads(model)))
        moved = after["bytes_d2h"] - before["bytes_d2h"]
        counted = moved == off.stats["bytes_offloaded"]
        print(f"{name}: {s / ref_s:.3f}x the reference's step time, {peak / ref_peak:.3f}x its "
              f"peak VRAM; policy {off.policy}; gradients exact: {exact}; d2h bytes counted: "
              f"{counted} ({moved / 2**20:.0f} MiB); pinned_by_tag {tags}")
        if kwargs.get("offload") == "auto":
            d = off.decision
            print(f"  auto: settled={d.get('settled')}, offloaded {d.get('offloaded_blocks')}, "
                  f"why: {d.get('why')}")
            for h in d.get("history", []):
                print(f"    {h}")
        failures += (not exact) + (not counted)
        off.remove()
        del model, off
        torch.cuda.empty_cache()
    print("PASS" if failures == 0 else f"FAIL ({failures} checks)")
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
