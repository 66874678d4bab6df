"""Full fine-tune of a Qwen2.5-1.5B-shaped model (random weights, bf16 autocast): step
time and peak VRAM for stock PyTorch (fused AdamW, uncapped), TrainStream under a VRAM
cap, and FSDP2 + CPUOffloadPolicy (one process), each in its own process so peaks
don't mix. Prints a table and JSON lines; docs/offload.md has the runs.

    python benchmarks/wrap/bench_offload.py --cap-gib 24 [--small] [--modes stock,trainstream,trainstream-gpu,fsdp2]

`--small` shrinks the model so the script can be checked on a CPU machine (no cap).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def qwen_config(small: bool):
    from transformers import Qwen2Config
    if small:
        return Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                           max_position_embeddings=256, tie_word_embeddings=True)
    # Qwen2.5-1.5B's published shape.
    return Qwen2Config(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                       num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                       max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
                       tie_word_embeddings=True)


def run_mode(args) -> dict:
    import torch
    from transformers import Qwen2ForCausalLM

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)
    cfg = qwen_config(args.small)
    cfg._attn_implementation = "sdpa"
    result = {"mode": args.mode, "cap_gib": args.cap_gib if args.mode != "stock" else None}
    if cuda and args.mode != "stock" and args.cap_gib:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(args.cap_gib * 2**30 / total)
    with torch.device(dev):
        model = Qwen2ForCausalLM(cfg)
    if args.checkpointing:
        model.gradient_checkpointing_enable()
        result["checkpointing"] = True
    result["params"] = sum(p.numel() for p in model.parameters())
    seq, batch = (64, 2) if args.small else (args.seq, args.batch)
    ids = torch.randint(cfg.vocab_size, (batch, seq), device=dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=cuda)
    if args.mode.startswith("trainstream"):
        import trainstream
        t0 = time.perf_counter()
        # trainstream: daemon AdamW; trainstream-gpu: zero-copy CUDA AdamW;
        # trainstream-gpu-bf16: the same with bf16 moments (half the PCIe bytes).
        extra = {"optimizer_mode": "cpu", "offload": True}
        if args.mode.startswith("trainstream-gpu"):
            extra = {"optimizer_mode": "gpu", "free_grads": True, "offload": True}
        if args.mode.endswith("-bf16"):
            extra["moment_dtype"] = "bfloat16"
        model, opt = trainstream.wrap(model, opt, socket=args.socket, **extra)
        result["wrap_s"] = time.perf_counter() - t0
    elif args.mode == "fsdp2":
        import torch.distributed as dist
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
        for layer in model.model.layers:
            fully_shard(layer, offload_policy=CPUOffloadPolicy())
        fully_shard(model, offload_policy=CPUOffloadPolicy())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    times, fwd, bwd = [], [], []
    for step in range(args.warmup + args.steps):
        sync()
        t0 = time.perf_counter()
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        sync()
        t1 = time.perf_counter()
        loss.backward()
        sync()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        t3 = time.perf_counter()
        if step >= args.warmup:
            times.append(t3 - t0)
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
    mid = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    result.update(step_s=mid(times), fwd_s=mid(fwd), bwd_s=mid(bwd), loss=float(loss))
    if cuda:
        result["peak_vram_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if args.mode.startswith("trainstream"):
        import trainstream
        t = trainstream.transfer_stats(opt)
        steps = max(t["steps"], 1)
        per_step = (t["bytes_d2h"] + t["bytes_h2d"] + t.get("bytes_pcie", 0)) / steps
        result["pcie_bytes_per_step"] = per_step
        result["pcie_gb_s_during_step"] = per_step / result["step_s"] / 1e9
        if cuda and args.mode == "trainstream":
            result.update(large_tensor_transfer(opt))
    return result


def large_tensor_transfer(opt) -> dict:
    """GB/s of the data plane's copies on the largest parameter: H2D through
    DataPlane.copy_param from its registered staging slot, and D2H into its slot."""
    import torch
    e = max(opt._table.entries.values(), key=lambda e: e.param.numel())
    nbytes = e.param.numel() * e.param.element_size()
    out = {"transfer_tensor_mib": nbytes / 2**20}
    for name, fn in (("h2d", lambda: opt._session.plane.copy_param(e.param, e.param_slot)),
                     ("d2h", lambda: e.grad_slot.copy_(e.param.detach().reshape(-1),
                                                       non_blocking=True))):
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        out[f"transfer_{name}_gb_s"] = 5 * nbytes / (time.perf_counter() - t0) / 1e9
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--modes", default="stock,trainstream,trainstream-gpu,fsdp2")
    ap.add_argument("--cap-gib", type=float, default=24.0)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--checkpointing", action="store_true")
    ap.add_argument("--socket", default=None)
    ap.add_argument("--adamw-gparams", type=float, default=None,
                    help="host AdamW throughput for the floor (default: from the engine benchmark)")
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=300)
    args = ap.parse_args()
    if args.mode:
        try:
            print("RESULT " + json.dumps(run_mode(args)), flush=True)
        except Exception as e:  # noqa: BLE001 (reported, not hidden)
            import torch
            r = {"mode": args.mode, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            if torch.cuda.is_available():
                r["peak_vram_gib"] = torch.cuda.max_memory_allocated() / 2**30
            print("RESULT " + json.dumps(r), flush=True)
        return 0
    results = []
    for mode in args.modes.split(","):
        variants = [False, True] if mode.startswith("trainstream") or mode == "fsdp2" else [False]
        for ckpt in variants:
            cmd = [sys.executable, __file__, "--mode", mode, "--cap-gib", str(args.cap_gib),
                   "--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps),
                   "--warmup", str(args.warmup)]
            cmd += ["--small"] if args.small else []
            cmd += ["--checkpointing"] if ckpt else []
            cmd += ["--socket", args.socket] if args.socket else []
            try:
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
                line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
                r = json.loads(line[-1][7:]) if line else {
                    "mode": mode, "error": f"exit {out.returncode}: {out.stderr[-400:]}"}
            except subprocess.TimeoutExpired:
                r = {"mode": mode, "error": f"timed out after {args.timeout} s"}
            r.setdefault("checkpointing", ckpt)
            results.append(r)
            print(json.dumps(r), flush=True)
            if "error" not in r:
                break  # fits without checkpointing: no need for the fallback
    stock = next((r for r in results if r["mode"] == "stock" and "error" not in r), None)
    fsdp = next((r for r in results if r["mode"] == "fsdp2" and "error" not in r), None)
    print(f"\n{'mode':<12} {'ckpt':<5} {'cap':>5} {'s/step':>8} {'peak GiB':>9} {'PCIe GB/s':>9}  note")
    for r in results:
        print(f"{r['mode']:<12} {str(r.get('checkpointing', False)):<5} {str(r.get('cap_gib')):>5} "
              f"{r.get('step_s', float('nan')):>8.3f} {r.get('peak_vram_gib', float('nan')):>9.1f} "
              f"{r.get('pcie_gb_s_during_step', float('nan')):>9.1f}  {r.get('error', '')[:90]}")
    for r in results:
        if "transfer_h2d_gb_s" in r:
            print(f"\nlarge-tensor transfers ({r['transfer_tensor_mib']:.0f} MiB, registered shm): "
                  f"H2D {r['transfer_h2d_gb_s']:.1f} GB/s, D2H {r['transfer_d2h_gb_s']:.1f} GB/s")
    ts = next((r for r in results if r["mode"] == "trainstream" and "error" not in r), None)
    for tg in [r for r in results if r["mode"].startswith("trainstream-gpu") and "error" not in r]:
        if stock:
            print(f"{tg['mode']}: {tg['step_s']:.3f} s/step = "
                  f"{tg['step_s'] / (stock['fwd_s'] + stock['bwd_s']):.2f}x stock fwd+bwd"
                  + (f"; / FSDP2+offload = {tg['step_s'] / fsdp['step_s']:.2f}x" if fsdp else ""))
    if stock and ts:
        gps = args.adamw_gparams or 4.2
        t_adamw = ts["params"] / (gps * 1e9)
        floor = stock["fwd_s"] + max(stock["bwd_s"], t_adamw)
        print(f"\nfloor t_fwd + max(t_bwd, t_adamw) = {stock['fwd_s']:.3f} + max({stock['bwd_s']:.3f}, "
              f"{t_adamw:.3f}) = {floor:.3f} s (host AdamW {gps} Gparam/s)")
        print(f"TrainStream / floor = {ts['step_s'] / floor:.2f}x"
              + (f"; / FSDP2+offload = {ts['step_s'] / fsdp['step_s']:.2f}x" if fsdp else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
