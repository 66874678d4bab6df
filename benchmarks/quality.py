#!/usr/bin/env python3
"""Quality of each quantized base format (docs/benchmarks-compare.md): held-out
perplexity of a model whose frozen block weights are stored as bf16, int8, NF4, FP8 or
NVFP4, before and after a short LoRA fine-tune on each base.

Nothing is downloaded. The model is trained here, from scratch, on real text that ships
with every machine: the Python standard library's own sources
(``sysconfig.get_paths()["stdlib"]``, site-packages left out), read as bytes (a
byte-level model: 256 tokens, no tokenizer to fit). Each file goes to one split by a
hash of its path: held-out (1 in 20), fine-tune (2 in 20), pre-training (the rest).

1. Pre-train a small Qwen2-shaped model (fp32 weights, bf16 autocast on a GPU) on the
   pre-training split; save it as a bf16 safetensors checkpoint.
2. For each format: ``load_model(checkpoint, quantize=format)`` (the daemon's shared
   base; "none" keeps bf16), PEFT LoRA (r=16, every projection), ``trainstream.wrap``;
   held-out perplexity (the adapters start at zero: the base's own), then the same
   LoRA steps on the same fine-tune windows, then held-out perplexity again.
3. Each format's perplexity against bf16's, before and after.

    python benchmarks/quality.py --out quality.json             # GPU host: a few minutes
    python benchmarks/quality.py --tiny --out /tmp/quality.json # CPU: about a minute

Prints a Markdown table; ``compare.py --readme ... --quality quality.json`` renders it
in the README section.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import shlex
import shutil
import sys
import sysconfig
import tempfile
import time
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from headtohead import report  # noqa: E402
from headtohead.measure import matmul_paths  # noqa: E402
from headtohead.scenarios import LORA  # noqa: E402
from bench_paging import start_daemon  # noqa: E402 (benchmarks/paging, on sys.path via scenarios)

FORMATS = ("none", "int8", "nf4", "fp8", "nvfp4")
# Multiples of 64 everywhere: every format's block fits every weight.
MODELS = {
    "default": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                    num_attention_heads=8, num_key_value_heads=2),
    "tiny": dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),
}
SETTINGS = {  # pre-train steps, batch, seq, LoRA steps, held-out windows, corpus cap (bytes)
    "default": dict(pretrain_steps=1500, batch=32, seq=512, lora_steps=300, windows=256,
                    max_bytes=None),
    "tiny": dict(pretrain_steps=120, batch=16, seq=64, lora_steps=30, windows=32,
                 max_bytes=3_000_000),
}


def log(*parts) -> None:
    print(*parts, file=sys.stderr, flush=True)


def read_corpus(max_bytes=None):
    """(pretrain, finetune, heldout) byte strings of the standard library's .py files and
    a description; files sorted by path, each to one split by CRC-32 of its path."""
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(f for f in glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
                   if "site-packages" not in f and "dist-packages" not in f)
    if not files:
        raise SystemExit(f"no .py files under the standard library's folder {root!r}")
    splits = {"pretrain": [], "finetune": [], "heldout": []}
    total = 0
    for path in files:
        rel = os.path.relpath(path, root)
        bucket = zlib.crc32(rel.encode()) % 20
        name = "heldout" if bucket == 0 else "finetune" if bucket in (1, 2) else "pretrain"
        with open(path, "rb") as f:
            data = f.read()
        splits[name].append(data)
        total += len(data)
        if max_bytes and total >= max_bytes:
            break
    out = {k: b"\n".join(v) for k, v in splits.items()}
    desc = {"description": f"the Python {sys.version.split()[0]} standard library's .py sources, bytes",
            "root": root, "files": sum(len(v) for v in splits.values()),
            **{f"{k}_bytes": len(v) for k, v in out.items()}}
    for k, v in out.items():
        if len(v) < 4 * 1024:
            raise SystemExit(f"the {k} split has only {len(v)} bytes; give more text (--max-bytes)")
    return out, desc


def windows(data, seq: int, count: int, generator=None):
    """``count`` windows of ``seq + 1`` bytes as a (count, seq + 1) int64 tensor: random
    starts with ``generator``, else evenly spaced (the held-out windows)."""
    import torch
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    span = len(t) - seq - 1
    if generator is not None:
        starts = torch.randint(span, (count,), generator=generator)
    else:
        starts = torch.linspace(0, span, count).long()
    return torch.stack([t[s:s + seq + 1] for s in starts.tolist()]).long()


def _loss(model, ids, device, autocast: bool):
    import torch
    with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
        return model(input_ids=ids, labels=ids, use_cache=False).loss


def perplexity(model, heldout, device, autocast, batch: int) -> float:
    """exp(mean next-byte NLL) over the held-out windows (every window the same length,
    so the mean of the batch means is the mean over tokens)."""
    import torch
    was = model.training
    model.eval()
    total, n = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(heldout), batch):
            chunk = heldout[i:i + batch].to(device)
            total += float(_loss(model, chunk, device, autocast)) * len(chunk)
            n += len(chunk)
    model.train(was)
    return math.exp(total / n)


def pretrain(cfg_shape, data, s, device, seed):
    """The small model trained from scratch (fp32 weights) and what the training did."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=256, max_position_embeddings=max(4096, s["seq"] + 1), rope_theta=1e4,
                      tie_word_embeddings=False, **cfg_shape)
    cfg._attn_implementation = "sdpa"
    model = Qwen2ForCausalLM(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, betas=(0.9, 0.95))
    steps = s["pretrain_steps"]
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * i / steps))))
    g = torch.Generator().manual_seed(seed)
    autocast = device == "cuda"
    losses, t0 = [], time.perf_counter()
    for i in range(steps):
        ids = windows(data, s["seq"], s["batch"], g).to(device)
        loss = _loss(model, ids, device, autocast)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if i % max(1, steps // 10) == 0 or i == steps - 1:
            losses.append([i, round(loss.item(), 4)])
            log(f"pre-train step {i}: loss {loss.item():.4f}")
    info = {"params": sum(p.numel() for p in model.parameters()), "config": cfg_shape,
            "pretrain_steps": steps, "pretrain_losses": losses,
            "pretrain_s": round(time.perf_counter() - t0, 1)}
    return model, info


def one_format(fmt, folder, finetune, heldout, s, args, device, sock) -> dict:
    """load_model(quantize=fmt) + LoRA + wrap: perplexity before, LoRA steps, after."""
    import peft
    import torch
    import trainstream
    from trainstream.integrations.huggingface import load_model
    t0 = time.perf_counter()
    model = load_model(folder, quantize=None if fmt == "none" else fmt, socket=sock)
    model.config.use_cache = False
    base_bytes = sum(b.numel() * b.element_size() for b in model.state_dict().values())
    model = peft.get_peft_model(model, peft.LoraConfig(task_type="CAUSAL_LM", **LORA))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lora_lr,
                            weight_decay=0.0)
    opts = dict(socket=sock, job="quality")
    if device == "cuda":
        opts["device"] = "cuda"
    model, opt = trainstream.wrap(model, opt, **opts)
    autocast = True  # the base is bf16 (or dequantized to it): bf16 compute on either device
    before = perplexity(model, heldout, device, autocast, s["batch"])
    g = torch.Generator().manual_seed(args.seed + 1)  # the same windows for every format
    losses = []
    for _ in range(s["lora_steps"]):
        ids = windows(finetune, s["seq"], s["batch"], g).to(device)
        loss = _loss(model, ids, device, autocast)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(round(loss.item(), 4))
    after = perplexity(model, heldout, device, autocast, s["batch"])
    return {"format": "bf16" if fmt == "none" else fmt, "quantize": fmt, "ppl_before": round(before, 4),
            "ppl_after": round(after, 4), "state_bytes": base_bytes, "lora_loss_first": losses[0],
            "lora_loss_last": losses[-1], "matmul_paths": matmul_paths(model),
            "seconds": round(time.perf_counter() - t0, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default=",".join(FORMATS),
                    help=f"comma-separated, of {', '.join(FORMATS)} ('none' is bf16, the reference)")
    ap.add_argument("--tiny", action="store_true", help="a tiny model and corpus: CPU, about a minute")
    ap.add_argument("--pretrain-steps", type=int, default=None)
    ap.add_argument("--train-steps", type=int, default=None, help="LoRA steps on each base")
    ap.add_argument("--windows", type=int, default=None, help="held-out windows measured")
    ap.add_argument("--seq", type=int, default=None, help="bytes per window")
    ap.add_argument("--lora-lr", type=float, default=1e-3,
                    help="LoRA learning rate (default 1e-3: a short fine-tune of a small model)")
    ap.add_argument("--max-bytes", type=int, default=None, help="read at most this much of the corpus")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto", help="auto, cuda or cpu")
    ap.add_argument("--socket", default=None, help="an existing daemon (else a private one)")
    ap.add_argument("--budget", default="50%", help="shared-memory budget of the private daemon")
    ap.add_argument("--out", default="quality.json", help="the results JSON")
    ap.add_argument("--keep", default=None, help="keep the pre-trained checkpoint in this folder")
    args = ap.parse_args(argv)
    fmts = [f.strip() for f in args.formats.split(",") if f.strip()]
    bad = [f for f in fmts if f not in FORMATS]
    if bad or not fmts:
        ap.error(f"--formats {args.formats!r}: unknown {bad or '(none)'}; accepted: {', '.join(FORMATS)}")
    if "none" not in fmts:
        fmts.insert(0, "none")  # the reference every format is compared with
    size = "tiny" if args.tiny else "default"
    s = dict(SETTINGS[size])
    for name, key in (("pretrain_steps", "pretrain_steps"), ("train_steps", "lora_steps"),
                      ("windows", "windows"), ("seq", "seq"), ("max_bytes", "max_bytes")):
        value = getattr(args, name)
        if value is not None:
            if value < 1:
                ap.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
            s[key] = value
    import torch
    if args.device not in ("auto", "cuda", "cpu"):
        ap.error(f"--device {args.device!r}: accepted: auto, cuda, cpu")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device in this process")
    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else \
        ("cpu" if args.device == "auto" else args.device)
    data, corpus = read_corpus(s["max_bytes"])
    log(f"corpus: {corpus}")
    folder = args.keep or tempfile.mkdtemp(prefix="quality-ckpt-")
    proc, cleanup = None, []
    sock = args.socket
    doc = {"tool": "benchmarks/quality.py",
           "command": "python benchmarks/quality.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
           "created": time.strftime("%Y-%m-%d %H:%M:%S"), "device": device,
           "gpu": torch.cuda.get_device_name() if device == "cuda" else None, "torch": torch.__version__,
           "corpus": corpus, "settings": s,
           "lora": {"r": LORA["r"], "alpha": LORA["lora_alpha"], "steps": s["lora_steps"], "lr": args.lora_lr},
           "formats": []}
    try:
        if sock is None:
            proc, sock, cleanup = start_daemon(args.budget)
        model, doc["model"] = pretrain(MODELS[size], data["pretrain"], s, device, args.seed)
        heldout = windows(data["heldout"], s["seq"], s["windows"])
        doc["model"]["fp32_heldout_ppl"] = round(perplexity(model, heldout, device, device == "cuda",
                                                            s["batch"]), 4)
        model.to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)  # the checkpoint
        del model
        for fmt in fmts:
            try:
                row = one_format(fmt, folder, data["finetune"], heldout, s, args, device, sock)
            except Exception as e:  # noqa: BLE001 (a format that fails is a row with its reason)
                row = {"format": fmt, "quantize": fmt, "error": f"{type(e).__name__}: {str(e)[:400]}"}
            doc["formats"].append(row)
            log(json.dumps(row))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
        for d in cleanup:
            shutil.rmtree(d, ignore_errors=True)
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    ref = next((r for r in doc["formats"] if r.get("quantize") == "none" and "error" not in r), None)
    for r in doc["formats"]:
        if ref is not None and "error" not in r:
            r["vs_bf16_before"] = round(r["ppl_before"] / ref["ppl_before"] - 1, 4)
            r["vs_bf16_after"] = round(r["ppl_after"] / ref["ppl_after"] - 1, 4)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(report.quality_table(doc))
    return 0 if ref is not None and all("error" not in r for r in doc["formats"]) else 1


if __name__ == "__main__":
    sys.exit(main())
