"""Forward+backward time and peak memory of the LM-head loss: full logits vs chunked.

Compares F.cross_entropy on the full logits (upcast to fp32, as Hugging Face does),
trainstream.chunked_cross_entropy at several chunk sizes and, when importable, Liger's
LigerFusedLinearCrossEntropyLoss. Prints a table with ratios against F.cross_entropy
of the same run and writes one JSON line per case to --out.

    python benchmarks/losses/bench_chunked_ce.py                     # H200: full sizes
    python benchmarks/losses/bench_chunked_ce.py --vocab 2048 --dims 64 --tokens 256 --device cpu
"""
import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from trainstream import chunked_cross_entropy


def _full(h, w, t):
    return F.cross_entropy((h @ w.t()).float(), t)


def _methods(chunks):
    out = {"F.cross_entropy": _full}
    for c in chunks:
        out[f"chunked_{c}"] = lambda h, w, t, c=c: chunked_cross_entropy(h, w, t, chunk_size=c)
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        liger = LigerFusedLinearCrossEntropyLoss()
        out["liger"] = lambda h, w, t: liger(w, h, t)
    except ImportError:
        print("liger: not installed")
    return out


def _measure(fn, h, w, t, repeats, device):
    cuda = device.type == "cuda"
    times = []
    for i in range(repeats + 1):
        h.grad = w.grad = None
        if cuda:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            t0 = time.perf_counter()
        fn(h, w, t).backward()
        if cuda:
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end)
            peak = torch.cuda.max_memory_allocated() - base
        else:
            ms, peak = (time.perf_counter() - t0) * 1e3, None
        if i:  # the first run warms up (cuBLAS handles, Triton compiles)
            times.append(ms)
    return statistics.median(times), peak


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--dims", type=int, nargs="+", default=[1536, 5120])
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--chunks", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None, help="file for one JSON line per case")
    args = ap.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    methods = _methods(args.chunks)
    sink = open(args.out, "a") if args.out else None
    print(f"{'D':>6} {'N':>6} {'method':<16} {'ms':>9} {'x time':>7} {'peak MiB':>9} {'x mem':>7}")
    for d in args.dims:
        for n in args.tokens:
            g = torch.Generator().manual_seed(0)
            h = torch.randn(n, d, generator=g).to(device, dtype).requires_grad_()
            w = (torch.randn(args.vocab, d, generator=g) / d ** 0.5).to(device, dtype).requires_grad_()
            t = torch.randint(0, args.vocab, (n,), generator=g).to(device)
            ref = None
            for name, fn in methods.items():
                ms, peak = _measure(fn, h, w, t, args.repeats, device)
                ref = ref or (ms, peak)
                x_t = ms / ref[0]
                x_m = peak / ref[1] if peak is not None and ref[1] else float("nan")
                mib = peak / 2**20 if peak is not None else float("nan")
                print(f"{d:>6} {n:>6} {name:<16} {ms:>9.2f} {x_t:>7.2f} {mib:>9.0f} {x_m:>7.2f}")
                if sink:
                    sink.write(json.dumps(dict(vocab=args.vocab, dim=d, tokens=n, dtype=args.dtype,
                                               method=name, ms=ms, peak_bytes=peak,
                                               time_ratio=x_t, mem_ratio=x_m,
                                               device=str(device))) + "\n")
            del h, w, t
    if sink:
        sink.close()


if __name__ == "__main__":
    main()
