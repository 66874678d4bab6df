"""Fine-tune a Hugging Face causal LM with ``TrainStreamTrainer``, optionally beside the
stock ``transformers.Trainer`` on the same model, data and arguments.

Data needs no download: byte-level tokens of text that ships with Python (the
standard library's sources), or ``--text FILE``. The model is built from a Qwen2.5
shape with random weights, or read from ``--model PATH`` (a folder or a reachable id).

    python examples/hf_finetune.py --model qwen2.5-0.5b --compare
    python examples/hf_finetune.py --model qwen2.5-1.5b --lora --activation-offload
    python examples/hf_finetune.py --tiny --compare      # small shapes; CPU is fine

``TrainStreamTrainer`` takes any ``wrap()`` option as ``trainstream={...}``;
``--activation-offload`` passes ``activation_offload=True`` there, which pages every
block's saved activations to host memory.
"""
from __future__ import annotations

import argparse
import inspect
import os
import sys
import tempfile
import time

import torch

from _common import gib, pick_device

SHAPES = {  # Qwen2.5's published shapes
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=True),
}
VOCAB = 256  # byte-level tokens


class ByteTokens(torch.utils.data.Dataset):
    """Windows of ``seq`` bytes of ``text``; labels are the inputs (causal LM)."""

    def __init__(self, text: str, seq: int, n: int, seed: int = 0):
        data = torch.tensor(list(text.encode()), dtype=torch.long)
        g = torch.Generator().manual_seed(seed)
        starts = torch.randint(len(data) - seq - 1, (n,), generator=g)
        self.rows = torch.stack([data[s:s + seq] for s in starts])

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def stdlib_text() -> str:
    import argparse as a
    import json.decoder as j
    import textwrap as t
    return "".join(inspect.getsource(m) for m in (t, a, j))


def build_model(args):
    from transformers import AutoModelForCausalLM, Qwen2Config
    torch.manual_seed(0)
    if args.model in SHAPES:
        cfg = Qwen2Config(vocab_size=VOCAB, max_position_embeddings=4096, **SHAPES[args.model])
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    if args.lora:
        import peft
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                            "down_proj"]))
    return model


def run(engine: str, args, device: str, dataset) -> dict:
    import transformers
    from trainstream.integrations.huggingface import TrainStreamTrainer
    model = build_model(args)
    out = tempfile.mkdtemp(prefix=f"hf-finetune-{engine}-")
    targs = transformers.TrainingArguments(
        output_dir=out, per_device_train_batch_size=args.batch, max_steps=args.steps,
        learning_rate=args.lr, weight_decay=0.0, max_grad_norm=1.0, logging_steps=1,
        save_strategy="no", report_to=[], use_cpu=device == "cpu", seed=0,
        bf16=device == "cuda", dataloader_num_workers=0, disable_tqdm=True)
    if engine == "stock":
        trainer = transformers.Trainer(model=model, args=targs, train_dataset=dataset)
    else:
        options = {"job": "hf_finetune", **({"socket": args.socket} if args.socket else {})}
        if args.activation_offload:
            options.update(activation_offload=True, min_offload_bytes=1024)
        trainer = TrainStreamTrainer(model=model, args=targs, train_dataset=dataset,
                                     trainstream=options)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - t0
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
    paged = None
    if engine != "stock" and args.activation_offload:
        import trainstream
        paged = trainstream.memory_report(trainer.model)["activations"].get("bytes_offloaded", 0)
    return {"engine": engine, "losses": losses, "seconds": seconds, "peak": peak,
            "offloaded": paged}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None,
                    help=f"a shape ({', '.join(SHAPES)}; random weights) or a folder / Hub id "
                         "(default qwen2.5-0.5b; --tiny: tiny)")
    ap.add_argument("--lora", action="store_true", help="LoRA r=16 on every projection (PEFT)")
    ap.add_argument("--compare", action="store_true", help="run the stock Trainer too")
    ap.add_argument("--activation-offload", action="store_true",
                    help="page saved activations to host memory (ActivationOffloader)")
    ap.add_argument("--text", default=None, help="a text file to train on (default: stdlib sources)")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps (default 10; --tiny 5)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=None, help="tokens (default 512; --tiny 32)")
    ap.add_argument("--lr", type=float, default=None, help="default 2e-5 (full) or 2e-4 (LoRA)")
    ap.add_argument("--device", default="auto", help="auto, cuda or cpu")
    ap.add_argument("--tiny", action="store_true", help="small shapes (seconds on a CPU)")
    ap.add_argument("--socket", default=None, help="the daemon's socket (else the default)")
    args = ap.parse_args(argv)
    args.model = args.model or ("tiny" if args.tiny else "qwen2.5-0.5b")
    args.steps = args.steps or (5 if args.tiny else 10)
    args.seq = args.seq or (32 if args.tiny else 512)
    # A tiny model moves little per step: a larger rate shows the loss fall in 5 steps.
    args.lr = args.lr or (2e-4 if args.lora else 2e-5) * (10 if args.tiny else 1)
    if args.text is not None and not os.path.isfile(args.text):
        ap.error(f"--text {args.text!r}: no such file")
    device = pick_device(args.device)
    if device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # Trainer would otherwise pick a GPU
    text = open(args.text, encoding="utf-8", errors="replace").read() if args.text else stdlib_text()
    dataset = ByteTokens(text, args.seq, n=args.batch * args.steps)
    results = [run("trainstream", args, device, dataset)]
    if args.compare:
        results.append(run("stock", args, device, dataset))
    print(f"\n{'engine':<12} {'s total':>8} {'peak VRAM':>11}  losses")
    for r in results:
        print(f"{r['engine']:<12} {r['seconds']:>8.2f} {gib(r['peak']):>11}  "
              + " ".join(f"{v:.4f}" for v in r["losses"]))
        print(f"LOSSES {r['engine']} " + " ".join(f"{v:.6f}" for v in r["losses"]))
        if r["offloaded"] is not None:
            print(f"activations paged to host memory by the last step: {gib(r['offloaded'])}")
    if len(results) == 2:
        a, b = (r["losses"] for r in results)
        print(f"largest loss difference, TrainStream vs stock: "
              f"{max(abs(x - y) for x, y in zip(a, b)):.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
