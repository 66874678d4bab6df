"""Train a GPT whose fp32 weights alone are larger than the GPU memory it may use.

The default model has 34 blocks of width 2048: 1.82B parameters, 7.3 GB of fp32
weights, and with AdamW's moments and gradients about 29 GB to train. It stays on
the CPU; ``trainstream.wrap(..., device="cuda", vram_limit=...)`` plans which blocks
stay on the GPU and which page in from host memory, and puts the optimizer's master
weights and moments in the daemon's shared memory.

    python examples/train_bigger_than_vram.py                      # 4 GiB cap, fp32 moments
    python examples/train_bigger_than_vram.py --vram-gb 8 --moments bf16
    python examples/train_bigger_than_vram.py --tiny               # small shapes, CPU is fine

On a machine without a GPU (or with ``--tiny --device cpu``) the same loop runs
through ``wrap()`` without ``device=``: the optimizer still lives in the daemon, and
the cap, if given, is a declared capacity the planner plans for.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

from _common import StepLog, daemon_status, gib, pick_device, session_state_bytes

import trainstream
from tiny_gpt import GPTConfig, TinyGPT

MOMENTS = {"fp32": "float32", "bf16": "bfloat16"}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vram-gb", type=float, default=None,
                    help="GPU memory the run may use, GiB (default 4; with --tiny on the CPU "
                         "none)")
    ap.add_argument("--moments", choices=sorted(MOMENTS), default="fp32",
                    help="precision of AdamW's moments in the daemon")
    ap.add_argument("--layers", type=int, default=None, help="blocks (default 34; --tiny 4)")
    ap.add_argument("--d-model", type=int, default=None, help="width (default 2048; --tiny 128)")
    ap.add_argument("--heads", type=int, default=None, help="attention heads (default d/128)")
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary (default 50304; --tiny 256)")
    ap.add_argument("--batch", type=int, default=None, help="sequences per step (default 4)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 512)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--device", default="auto", help="auto, cuda or cpu")
    ap.add_argument("--tiny", action="store_true", help="small shapes (seconds on a CPU)")
    ap.add_argument("--socket", default=None, help="the daemon's socket (else the default)")
    args = ap.parse_args(argv)
    tiny = args.tiny
    for name, full, small in (("layers", 34, 4), ("d_model", 2048, 128), ("vocab", 50304, 256),
                              ("batch", 4, 4), ("seq", 512, 64)):
        if getattr(args, name) is None:
            setattr(args, name, small if tiny else full)
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.heads is None:
        args.heads = max(1, args.d_model // 128)
    if args.d_model % args.heads:
        ap.error(f"--d-model {args.d_model} is not a multiple of --heads {args.heads}")
    if args.vram_gb is not None and args.vram_gb <= 0:
        ap.error(f"--vram-gb must be > 0, got {args.vram_gb}")
    return args


def _init_gpt2(module: torch.nn.Module) -> None:
    # GPT-2's initialisation: with torch's defaults the tied head starts from N(0, 1)
    # embeddings and the first losses are in the tens.
    if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
        torch.nn.init.normal_(module.weight, 0.0, 0.02)
        if getattr(module, "bias", None) is not None:
            torch.nn.init.zeros_(module.bias)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = pick_device(args.device)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers,
                    n_head=args.heads, n_embd=args.d_model)
    model = TinyGPT(cfg)  # built on the CPU: it need not fit the GPU
    model.apply(_init_gpt2)
    n = sum(p.numel() for p in model.parameters())
    print(f"model: {args.layers} blocks x {args.d_model}, {n / 1e9:.3f}B parameters, "
          f"{gib(4 * n)} of fp32 weights; moments {args.moments}", flush=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    options = dict(moment_dtype=MOMENTS[args.moments], socket=args.socket,
                   job="train_bigger_than_vram")
    vram_gb = args.vram_gb if args.vram_gb is not None else (None if device == "cpu" else 4.0)
    if vram_gb is not None:
        options["vram_limit"] = int(vram_gb * 2**30)
    if device == "cuda":
        options["device"] = "cuda"
    if args.tiny:
        options["min_offload_bytes"] = 1024  # tiny blocks' tensors page too
    model, optimizer = trainstream.wrap(model, optimizer, **options)
    report = trainstream.memory_report(model)
    plan = report.get("plan") or {}
    paged = plan.get("paged_blocks") or []
    print(f"wrap: device {device}, cap {gib(options.get('vram_limit'))}, optimizer_mode "
          f"{optimizer.optimizer_mode}, blocks paged from host memory: {len(paged)} of "
          f"{args.layers}", flush=True)

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    g = torch.Generator().manual_seed(1)
    log = StepLog(device)
    # One fixed batch: the loss falling over a few steps shows the updates land.
    x = torch.randint(args.vocab, (args.batch, args.seq), generator=g).to(device)
    y = torch.roll(x, -1, dims=1)
    for step in range(1, args.steps + 1):
        log.start()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        log.end(step, loss)
    status = daemon_status(args.socket)
    state = session_state_bytes(status, os.getpid())
    print(f"optimizer state in the daemon's shared memory: {gib(state)} "
          f"({state / n:.1f} B/param)")
    if device == "cuda" and vram_gb is not None:
        peak = torch.cuda.max_memory_allocated()
        print(f"peak VRAM {gib(peak)} within the {vram_gb:g} GiB cap: "
              f"{peak <= vram_gb * 2**30}")
    log.summary("train_bigger_than_vram")
    # No unwrap(): it would copy every paged weight back out of the daemon, and the
    # process ends here; the daemon frees the session when it goes.
    return 0


if __name__ == "__main__":
    sys.exit(main())
