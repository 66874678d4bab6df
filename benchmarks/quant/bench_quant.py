"""Quantization benchmark (run on the GPU host; docs/quantization.md has the results).

1. Dequantize throughput per format against the device-to-device copy bandwidth
   measured in the same run. Byte convention (the same for both): bytes that must cross
   DRAM once per call, read + written. Dequantize: code bytes + scale bytes (+ nvfp4's
   4-byte tensor scale) read, plus numel * 2 bf16 bytes written (= qt.nbytes + 2 *
   numel); a scale reused by several threads is counted once. Copy: n bytes read + n
   written. The quantized inputs rotate over enough copies to exceed twice the L2, so
   no call starts with its input in L2.
2. Forward and forward + backward (to the input) of a 512 x 5120 x 13824 linear layer
   per format (QuantLinear) against a bf16 nn.Linear. FP8 uses torch._scaled_mm where
   torch accepts it (see the "path" column); its forward is also broken down into the
   activation quantization and the _scaled_mm alone.

    PYTHONPATH=build/python python benchmarks/quant/bench_quant.py [--json out.json]
    (on the GPU host: python3 benchmarks/quant/build_quant_ext.py first, then
     PYTHONPATH=build-quant-ext/python)

Prints a table and then one JSON object (also written to --json when given).
"""
import argparse
import json
import sys

import torch

from trainstream import _C
from trainstream.frozen.quantization import QuantLinear, quantize_tensor

FORMATS = ("int8", "nf4", "fp8", "nvfp4")


def cuda_time_ms(fn, warmup=5, iters=50):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def copy_bandwidth(nbytes):
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = cuda_time_ms(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3) / 1e9  # read + write


def bench_dequant(numel):
    w = torch.randn(numel, device="cuda") * 0.02
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 64 << 20)
    rows = []
    for fmt in FORMATS:
        qt = quantize_tensor(w, fmt)
        out_bytes = numel * 2
        moved = qt.nbytes + out_bytes  # read once + written once (see the module docstring)
        n_copies = max(1, -(-2 * l2 // qt.nbytes))
        copies = [(qt.data.clone(), qt.scales.clone(), qt.tensor_scale.clone())
                  for _ in range(n_copies)]
        state = {"i": 0}

        def fn():
            d, sc, ts = copies[state["i"] % len(copies)]
            state["i"] += 1
            _C.quant.dequantize(d, sc, ts, fmt, numel, qt.block_size, torch.bfloat16)

        ms = cuda_time_ms(fn)
        q_ms = cuda_time_ms(lambda: quantize_tensor(w, fmt), warmup=2, iters=5)
        rows.append({"format": fmt, "ms": ms, "gb_per_s": moved / (ms * 1e-3) / 1e9,
                     "bytes_moved": moved, "input_copies": len(copies), "quantize_ms": q_ms})
        copies.clear()  # frees this format's input copies before the next format's
    return rows


def bench_linear(m=512, k=5120, n=13824):
    torch.manual_seed(0)
    lin = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    lin.requires_grad_(False)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)

    def fwd_bwd(mod):
        def run():
            x.grad = None
            mod(x).backward(g)
        return run

    def fwd(mod):
        def run():
            with torch.no_grad():
                mod(x)
        return run

    breakdown = None
    rows = [{"format": "bf16", "path": "nn.Linear", "fwd_ms": cuda_time_ms(fwd(lin)),
             "fwd_bwd_ms": cuda_time_ms(fwd_bwd(lin))}]
    for fmt in FORMATS:
        ql = QuantLinear.from_linear(lin, fmt)
        fwd_ms = cuda_time_ms(fwd(ql))
        rows.append({"format": fmt, "path": ql.matmul_path, "note": ql.matmul_note,
                     "fwd_ms": fwd_ms, "fwd_bwd_ms": cuda_time_ms(fwd_bwd(ql))})
        if fmt == "fp8" and ql.matmul_path == "fp8-scaled-mm-rowwise":
            breakdown = fp8_breakdown(ql, x)
    base = rows[0]
    for r in rows:
        r["fwd_vs_bf16"] = r["fwd_ms"] / base["fwd_ms"]
        r["fwd_bwd_vs_bf16"] = r["fwd_bwd_ms"] / base["fwd_bwd_ms"]
    return rows, breakdown


def fp8_breakdown(ql, x):
    """The FP8 forward's parts, each alone: activation quantization (fused kernel, and the
    eager PyTorch it replaced) and torch._scaled_mm."""
    from trainstream.frozen.quantization import _quantize_rows_e4m3_eager
    xd = x.detach()
    with torch.no_grad():
        xq, xs = ql._rows_e4m3(xd)
        out = {"act_quant_kernel_ms": cuda_time_ms(lambda: ql._rows_e4m3(xd)),
               "act_quant_eager_ms": cuda_time_ms(lambda: _quantize_rows_e4m3_eager(xd)),
               "scaled_mm_ms": cuda_time_ms(lambda: torch._scaled_mm(
                   xq, ql._fp8_wt, scale_a=xs, scale_b=ql._fp8_w_scale, bias=None,
                   out_dtype=torch.bfloat16)),
               "kernel_equals_eager": bool(torch.equal(
                   xq.view(torch.uint8), _quantize_rows_e4m3_eager(xd)[0].view(torch.uint8)))}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=5120 * 13824, help="dequantize size (elements)")
    ap.add_argument("--json", help="also write the JSON result here")
    args = ap.parse_args()
    if not torch.cuda.is_available() or not getattr(_C, "with_cuda", False):
        print("bench_quant: needs a CUDA GPU and trainstream._C built with CUDA", file=sys.stderr)
        return 2
    copy_gbps = copy_bandwidth(args.numel * 2)
    dq = bench_dequant(args.numel)
    lin, breakdown = bench_linear()
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"device copy bandwidth (read+write): {copy_gbps:8.1f} GB/s")
    print(f"\ndequantize {args.numel} elements to bf16")
    print(f"{'format':8} {'ms':>8} {'GB/s':>9} {'% of copy':>10} {'quantize ms':>12}")
    for r in dq:
        r["fraction_of_copy"] = r["gb_per_s"] / copy_gbps
        print(f"{r['format']:8} {r['ms']:8.3f} {r['gb_per_s']:9.1f} "
              f"{100 * r['fraction_of_copy']:9.1f}% {r['quantize_ms']:12.3f}")
    print("\nlinear 512 x 5120 x 13824, bf16 activations")
    print(f"{'format':8} {'path':24} {'fwd ms':>8} {'x bf16':>7} {'fwd+bwd ms':>11} {'x bf16':>7}")
    for r in lin:
        print(f"{r['format']:8} {r['path']:24} {r['fwd_ms']:8.3f} {r['fwd_vs_bf16']:7.2f} "
              f"{r['fwd_bwd_ms']:11.3f} {r['fwd_bwd_vs_bf16']:7.2f}")
    if breakdown:
        print("\nfp8 forward parts: " + ", ".join(
            f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in breakdown.items()))
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "copy_gb_per_s": copy_gbps,
              "bytes_convention": "dequantize: code + scale bytes read + numel*2 written; "
                                  "copy: n read + n written",
              "dequantize": dq, "linear": lin, "fp8_forward_parts": breakdown}
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
