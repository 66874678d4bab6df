"""The causal-LM loss without the full logits: trainstream.chunked_cross_entropy against
F.cross_entropy on the full logits (as Hugging Face computes it: bf16 logits upcast to
fp32) and Liger's fused linear cross-entropy, when ``liger_kernel`` is importable.

For each shape: forward + backward time (median of --iters, CUDA events), the peak
memory above the inputs (torch.cuda.max_memory_allocated; the gradients of hidden and,
for a trained output layer, of the weight are counted for every method alike), and the
gradients' error against fp32 logits (||g - g32|| / ||g32||). Ratios are against
F.cross_entropy in the same run.

Ours at each of --chunks (tokens per chunk; "default" is chunk_size=None, 256).

    python benchmarks/losses/bench_chunked_ce.py                # H200: Qwen2.5 shapes
    python benchmarks/losses/bench_chunked_ce.py --tiny         # CPU ok: checks the script
    python benchmarks/losses/bench_chunked_ce.py --source       # no build: the checkout's
                                                                #   python/trainstream/losses.py
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time
import types

import torch
import torch.nn.functional as F

if "--source" in sys.argv:  # the loss module alone, without building the package
    _pkg = types.ModuleType("trainstream")
    _pkg.__path__ = [str(pathlib.Path(__file__).resolve().parents[2] / "python" / "trainstream")]
    sys.modules["trainstream"] = _pkg
from trainstream.losses import chunked_cross_entropy  # noqa: E402

# (name, tokens, hidden size, vocab, output layer trained)
SHAPES = [("1.5b-full-2k", 2048, 1536, 151936, True),
          ("1.5b-full-8k", 8192, 1536, 151936, True),
          ("14b-lora-2k", 2048, 5120, 152064, False),
          ("14b-lora-8k", 8192, 5120, 152064, False)]
TINY = [("tiny", 96, 32, 500, True), ("tiny-frozen", 96, 32, 500, False)]


def full_logits(h, w, t, chunk):
    return F.cross_entropy(F.linear(h, w).float(), t)


def ours(h, w, t, chunk):
    return chunked_cross_entropy(h, w, t, chunk_size=chunk)


def reference_grads(h, w, t):
    """Gradients of the loss on fp32 logits of the fp32 inputs."""
    h32 = h.detach().float().requires_grad_()
    w32 = w.detach().float().requires_grad_(w.requires_grad)
    F.cross_entropy(F.linear(h32, w32), t).backward()
    return h32.grad, w32.grad


def rel_err(g, ref):
    if g is None or ref is None:
        return None
    return float((g.float() - ref).norm() / ref.norm())


def liger():
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        return None
    fn = LigerFusedLinearCrossEntropyLoss()
    return lambda h, w, t, chunk: fn(w, h, t)


def measure(fn, h, w, t, chunk, iters, cuda, ref):
    def once(keep=False):
        loss = fn(h, w, t, chunk)
        loss.backward()
        grads = (h.grad, w.grad)
        h.grad = None
        w.grad = None
        return (loss, grads) if keep else loss
    loss, grads = once(keep=True)
    err = [rel_err(g, r) for g, r in zip(grads, ref)]
    del grads
    loss = once()
    times = []
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    for _ in range(iters):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            loss = once()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            loss = once()
            times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() - base if cuda else 0
    return {"s": statistics.median(times), "peak_bytes": peak, "loss": loss.item(),
            "err_hidden": err[0], "err_weight": err[1]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--chunks", default="default,128,512,1024")
    ap.add_argument("--source", action="store_true",
                    help="load python/trainstream/losses.py from the checkout, unbuilt")
    ap.add_argument("--shapes", default=None, help="comma-separated names (default: all)")
    ap.add_argument("--out", default=None, help="JSON lines of every figure")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    methods = [("F.cross_entropy (full logits)", full_logits, None)]
    for c in args.chunks.split(","):
        methods.append((f"trainstream chunk {c}", ours, None if c == "default" else int(c)))
    lg = liger() if cuda else None
    if lg is not None:
        methods.append(("Liger fused linear CE", lg, None))
    else:
        print("liger: not installed" if cuda else "liger: CUDA only, not run")
    out = open(args.out, "w") if args.out else None
    print(f"device {torch.cuda.get_device_name() if cuda else 'cpu'}, dtype {dtype}")
    print("| shape | method | fwd+bwd s | x full | peak GiB above inputs | x full | loss "
          "| err grad h | err grad w |")
    print("|---|---|---|---|---|---|---|---|---|")
    shapes = TINY if args.tiny else SHAPES
    if args.shapes:
        shapes = [s for s in shapes if s[0] in args.shapes.split(",")]
    for name, n, d, v, trained in shapes:
        g = torch.Generator(device=dev).manual_seed(0)
        h = torch.randn(n, d, device=dev, dtype=dtype, generator=g).requires_grad_()
        w = (torch.randn(v, d, device=dev, dtype=dtype, generator=g) * 0.02).requires_grad_(trained)
        t = torch.randint(v, (n,), device=dev, generator=g)
        grads32 = reference_grads(h, w, t)
        if cuda:
            torch.cuda.empty_cache()
        ref = None
        for label, fn, chunk in methods:
            try:
                r = measure(fn, h, w, t, chunk, args.iters, cuda, grads32)
            except torch.OutOfMemoryError as e:
                r = {"error": f"out of memory: {str(e)[:120]}"}
            r.update(shape=name, method=label, tokens=n, hidden=d, vocab=v, trained_weight=trained)
            if ref is None:
                ref = r
            if "error" in r:
                print(f"| {name} | {label} | {r['error']} |")
            else:
                tr = r["s"] / ref["s"]
                mr = r["peak_bytes"] / ref["peak_bytes"] if ref.get("peak_bytes") else float("nan")
                eh, ew = r["err_hidden"], r["err_weight"]
                print(f"| {name} | {label} | {r['s']:.4f} | {tr:.2f} | "
                      f"{r['peak_bytes'] / 2**30:.3f} | {mr:.2f} | {r['loss']:.4f} | "
                      f"{eh:.2e} | {'-' if ew is None else f'{ew:.2e}'} |", flush=True)
            if out:
                out.write(json.dumps(r) + "\n")
        del h, w, t, grads32
        if cuda:
            torch.cuda.empty_cache()
    if out:
        out.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
