"""LoRA (r=16, every projection) on a Qwen2.5 base bigger than the GPU.

The base is built from Qwen2.5's published shapes with random weights (nothing is
downloaded) or, with ``--model``, from a Hub id or folder that is reachable. PEFT adds
the adapters to a bf16 base; ``trainstream.wrap(quantize=..., prefer=..., recompute=...,
attention=...)`` stores the frozen base quantized where asked or needed, pages what
does not fit the GPU and keeps the adapters' AdamW in the daemon. ``--stock`` trains
the same model with plain PyTorch (everything on the GPU) for comparison.

    python examples/lora_large_model.py --size 14b --quantize nf4 --vram-gb 24
    python examples/lora_large_model.py --size 14b --quantize fp8 --fp8-matmul dequantize
    python examples/lora_large_model.py --size 7b --stock
    python examples/lora_large_model.py --tiny            # small shapes; CPU is fine

This builds the bf16 base in the process, adds PEFT, then ``wrap(quantize=...)``
quantizes it. For a checkpoint on disk, ``integrations.huggingface.load_model(...,
quantize="nf4")`` reads it quantized into the daemon's shared cache instead (less host
memory for 32B, one copy for every job), and PEFT targets its ``QuantLinear`` layers the
same way (tests/python/test_peft_quant.py; benchmarks/headtohead's TrainStream engines).
"""
from __future__ import annotations

import argparse
import sys

import torch

from _common import StepLog, pick_device

import trainstream

SHAPES = {  # Qwen2.5's published shapes
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                 tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
               tie_word_embeddings=False),
    "14b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
                num_attention_heads=40, num_key_value_heads=8, vocab_size=152064,
                tie_word_embeddings=False),
    "32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                num_attention_heads=40, num_key_value_heads=8, vocab_size=152064,
                tie_word_embeddings=False),
}
TINY = dict(hidden_size=128, intermediate_size=320, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RECOMPUTE = {"auto": "auto", "on": True, "off": False}
ATTENTION = {"auto": "auto", "cudnn": "cudnn", "efficient": "efficient", "flash": "flash",
             "math": "math", "default": None}


def build_model(args, device: str):
    """The bf16 base (random weights from the shape, or ``--model``), frozen, with PEFT's
    LoRA adapters (fp32) on every projection."""
    import peft
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config
    if args.model:
        cfg = AutoConfig.from_pretrained(args.model)
    else:
        cfg = Qwen2Config(max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
                          **(TINY if args.tiny else SHAPES[args.size]))
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    # Random weights are drawn on the GPU when there is one (fast) and the model then
    # waits in host memory: wrap() decides what goes to the GPU.
    init = device if args.stock else ("cuda" if device == "cuda" else "cpu")
    with torch.device(init):
        if args.model:
            model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16)
        else:
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    if not args.stock and init != "cpu":
        model.to("cpu")
        torch.cuda.empty_cache()
    model = peft.get_peft_model(model, peft.LoraConfig(
        r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0, target_modules=TARGETS,
        task_type="CAUSAL_LM"))
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()  # adapters train in fp32 under bf16 autocast
    return model, cfg.vocab_size


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SHAPES), default="14b")
    ap.add_argument("--model", default=None, help="a Hub id or folder instead of --size")
    ap.add_argument("--quantize", choices=("auto", "none", "int8", "nf4", "fp8", "nvfp4"),
                    default="auto", help="storage of the frozen base's block weights")
    ap.add_argument("--prefer", choices=("exact", "speed"), default="exact")
    ap.add_argument("--fp8-matmul", choices=("auto", "dequantize"), default=None,
                    help="an FP8 base's forward: FP8 tensor cores where they run ('auto', "
                         "the default) or bf16 on the dequantized weight ('dequantize')")
    ap.add_argument("--recompute", choices=sorted(RECOMPUTE), default="auto")
    ap.add_argument("--attention", choices=sorted(ATTENTION), default="auto")
    ap.add_argument("--stock", action="store_true", help="plain PyTorch + PEFT, no TrainStream")
    ap.add_argument("--vram-gb", type=float, default=None, help="GPU memory cap, GiB")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=None, help="tokens (default 512; --tiny 32)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--device", default="auto", help="auto, cuda or cpu")
    ap.add_argument("--tiny", action="store_true", help="small shapes (seconds on a CPU)")
    ap.add_argument("--socket", default=None, help="the daemon's socket (else the default)")
    args = ap.parse_args(argv)
    for name in ("steps", "batch", "rank"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.vram_gb is not None and args.vram_gb <= 0:
        ap.error(f"--vram-gb must be > 0, got {args.vram_gb}")
    if args.seq is None:
        args.seq = 32 if args.tiny else 512
    device = pick_device(args.device)
    model, vocab = build_model(args, device)
    total = sum(p.numel() for p in model.parameters())
    trained = [p for p in model.parameters() if p.requires_grad]
    print(f"model: {args.model or ('tiny' if args.tiny else 'Qwen2.5-' + args.size)} shape, "
          f"{total / 1e9:.3f}B parameters, {sum(p.numel() for p in trained) / 1e6:.2f}M "
          f"trained (LoRA r={args.rank})", flush=True)
    optimizer = torch.optim.AdamW(trained, lr=args.lr)
    if args.stock:
        if device == "cuda" and args.vram_gb:
            torch.cuda.set_per_process_memory_fraction(
                args.vram_gb * 2**30 / torch.cuda.get_device_properties(0).total_memory)
        label = "stock PyTorch + PEFT"
    else:
        options = dict(quantize=None if args.quantize == "none" else args.quantize,
                       prefer=args.prefer, fp8_matmul=args.fp8_matmul,
                       recompute=RECOMPUTE[args.recompute],
                       attention=ATTENTION[args.attention], socket=args.socket,
                       job="lora_large_model")
        if device == "cuda":
            options["device"] = "cuda"
        if args.vram_gb:
            options["vram_limit"] = int(args.vram_gb * 2**30)
        model, optimizer = trainstream.wrap(model, optimizer, **options)
        plan = trainstream.memory_report(model).get("plan") or {}
        print(f"wrap: quantize {plan.get('quantize')}, blocks paged "
              f"{len(plan.get('paged_blocks') or [])}, optimizer_mode "
              f"{optimizer.optimizer_mode}", flush=True)
        label = f"TrainStream (quantize={args.quantize}, prefer={args.prefer})"
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    ids = torch.randint(vocab, (args.batch, args.seq),
                        generator=torch.Generator().manual_seed(1)).to(device)
    log = StepLog(device)
    for step in range(1, args.steps + 1):
        log.start()
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        log.end(step, loss)
    if not args.stock:
        from collections import Counter

        from trainstream.quantization import quant_report
        report = quant_report(model)
        paths = Counter((r["matmul_path"], r["note"]) for r in report)
        print(f"frozen linears stored quantized: {len(report)}; still adapting: "
              f"{model._trainstream_session.adapting}")
        for (path, note), n in sorted(paths.items()):
            print(f"  matmul path {path}: {n} ({note})")
    log.summary(label)
    return 0


if __name__ == "__main__":
    sys.exit(main())
