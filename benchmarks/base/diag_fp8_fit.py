"""Does the FP8 base's tensor-core forward slow a LoRA fit? A diagnostic for one finding.

The head-to-head's run on the H100 of 2026-12-07 02:58 UTC (docs/benchmarks-compare.md,
"What the runs show") saw the FP8 base, every block resident, reach a loss of 1.40 at step 10 where every other base
format reached 0.25; on 2026-12-04's H200, under the cap with 22 of 48 blocks resident,
it fit like NF4. This script separates the FP8 forward from everything else TrainStream
does (no daemon, no paging, plain torch AdamW):

1. Builds a Qwen2 model of the 14B scenario's widths with ``--layers`` blocks (random
   bf16 weights, std 0.02, norms 1, as compare.py's checkpoints), quantizes its blocks'
   linears to FP8 (``quantize_model``) and adds the head-to-head's LoRA (PEFT).
2. Trains ``--steps`` steps on one batch (random tokens, seed 1), AdamW at 2e-4 with
   compare.py's betas, eps and weight decay, under bf16 autocast, as compare.py's loop
   does; twice from the same start: "module" (the path each QuantLinear picks: on
   Hopper the FP8 tensor cores) and "dequantize" (``set_fp8_matmul(model, "dequantize")``,
   as wrap()'s ``fp8_matmul="dequantize"`` sets it: the bf16 matmul).
3. Prints both loss curves and the matmul paths each arm ran, and for each linear of
   the first and the last block, on the arm's real activations of step 1: the forward's
   error against ``F.linear`` on the dequantized weight (activation rounding alone gives
   about 2.7%), and whether the row-quantizer kernel's bytes equal the eager ones.

On a machine without FP8 tensor cores both arms dequantize, unless ``--emulate-fp8``:
the "module" arm then takes the FP8 path anyway, with ``torch._scaled_mm``'s row-wise
product computed in fp32 (exact products of the e4m3 codes, then the row scales and the
bias) and the eager activation quantizer: the path's arithmetic without its kernels.
``--hidden``, ``--intermediate``, ``--heads`` and ``--kv-heads`` narrow the model (a
48-block model of the 14B widths does not fit a CPU machine's memory).

    python benchmarks/base/diag_fp8_fit.py [--layers 8] [--steps 12] [--seq 512] [--json out.json]
    python benchmarks/base/diag_fp8_fit.py --tiny      # CPU: both arms dequantize (a smoke run)
    python benchmarks/base/diag_fp8_fit.py --emulate-fp8 --layers 48 --hidden 1024 \
        --intermediate 2816 --heads 8 --kv-heads 2     # CPU: the FP8 arithmetic, emulated
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from headtohead.measure import matmul_paths  # noqa: E402
from headtohead.scenarios import LORA  # noqa: E402

BETAS, EPS, WEIGHT_DECAY, LR = (0.9, 0.999), 1e-8, 0.01, 2e-4
WIDTHS = dict(hidden_size=5120, intermediate_size=13824, num_attention_heads=40,
              num_key_value_heads=8, vocab_size=152064)
TINY = dict(hidden_size=128, intermediate_size=384, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512)


def build(args, device):
    import torch
    import trainstream.integrations.peft  # noqa: F401  (registers QuantLinear as a LoRA target)
    import peft
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from trainstream.frozen.quantization import quantize_model
    widths = dict(TINY if args.tiny else WIDTHS)
    for key, arg in (("hidden_size", "hidden"), ("intermediate_size", "intermediate"),
                     ("num_attention_heads", "heads"), ("num_key_value_heads", "kv_heads")):
        if getattr(args, arg) is not None:
            widths[key] = getattr(args, arg)
    cfg = Qwen2Config(num_hidden_layers=args.layers, max_position_embeddings=4096,
                      tie_word_embeddings=False, **widths)
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02)
    model.requires_grad_(False)
    quantize_model(model, "fp8")
    torch.manual_seed(args.seed + 1)
    model = peft.get_peft_model(model, peft.LoraConfig(task_type="CAUSAL_LM", **LORA))
    model.train()
    return model, cfg


def probe_linears(model):
    """The QuantLinears of the first and the last block, and what their forwards see:
    ({name: (module, seen)}, hook handles). The first block's inputs need no gradient
    (the hot path, no autograd node); the last block's do (_QuantLinearFunction)."""
    from trainstream.frozen.quantization import QuantLinear
    named = [(n, m) for n, m in model.named_modules() if isinstance(m, QuantLinear)]
    blocks = sorted({n.split(".layers.")[1].split(".")[0] for n, _ in named}, key=int)
    keep = {blocks[0], blocks[-1]}
    probes: Dict[str, Any] = {}
    handles = []
    for name, ql in named:
        if name.split(".layers.")[1].split(".")[0] not in keep:
            continue
        seen: Dict[str, Any] = {}
        handles.append(ql.register_forward_hook(
            lambda m, inp, out, seen=seen: seen.update(
                x=inp[0].detach(), y=out.detach(), grad=inp[0].requires_grad)))
        probes[name.split(".layers.")[1].replace(".base_layer", "")] = (ql, seen)
    return probes, handles


def probe_result(ql, seen) -> Dict[str, Any]:
    """A QuantLinear's forward on the input it saw, against F.linear on the dequantized
    weight; and the row kernel's bytes against the eager quantizer's."""
    import torch
    import torch.nn.functional as F
    from trainstream.frozen.fp8_matmul import _quantize_rows_e4m3_eager
    if "x" not in seen:
        return {"error": "ran no forward"}
    x, y = seen["x"].to(torch.bfloat16), seen["y"]
    w = ql.qweight.dequantize(torch.float32).to(x.device)
    bias = ql.bias.float() if ql.bias is not None else None
    ref = F.linear(x.float(), w, bias)
    out = {"matmul_path": ql.matmul_path, "shape": [ql.out_features, ql.in_features],
           "bias": bias is not None, "input_requires_grad": bool(seen["grad"]),
           "rel_err_vs_dequantized": round(((y.float() - ref).norm() / ref.norm()).item(), 5)}
    if ql._rows_e4m3 is not None and ql._rows_e4m3 is not _quantize_rows_e4m3_eager:
        x2 = x.reshape(-1, ql.in_features)
        kq, ks = ql._rows_e4m3(x2)
        eq, es = _quantize_rows_e4m3_eager(x2)
        out["row_kernel_equals_eager"] = bool(torch.equal(ks, es) and torch.equal(
            kq.view(torch.uint8), eq.view(torch.uint8)))
    return out


@contextlib.contextmanager
def emulated_fp8():
    """QuantLinear takes its FP8 path on any device: row-wise ``torch._scaled_mm`` in fp32
    (the e4m3 codes' products are exact in fp32; the scales and the bias come after, as
    the tensor cores apply them) and the eager per-row activation quantizer."""
    import torch
    from trainstream.frozen.fp8_matmul import _quantize_rows_e4m3_eager
    from trainstream.frozen.quantization import QuantLinear

    def use_fp8(self, x):
        self.matmul_note = "fp8 emulated by diag_fp8_fit.py"
        return self.format == "fp8" and not self._paged

    def prepare(self, x):
        saved_prepare(self, x)
        if self._plan_fp8:
            self._rows_e4m3 = _quantize_rows_e4m3_eager

    def scaled_mm(a, b, scale_a, scale_b, bias=None, out_dtype=torch.bfloat16, **_):
        y = (a.float() @ b.float()) * scale_a * scale_b
        return (y if bias is None else y + bias.float()).to(out_dtype)

    saved_use, saved_prepare, saved_mm = QuantLinear._use_fp8, QuantLinear._prepare, torch._scaled_mm
    QuantLinear._use_fp8, QuantLinear._prepare, torch._scaled_mm = use_fp8, prepare, scaled_mm
    try:
        yield
    finally:
        QuantLinear._use_fp8, QuantLinear._prepare, torch._scaled_mm = saved_use, saved_prepare, saved_mm


def arm(args, device, force_dequantize: bool) -> Dict[str, Any]:
    import torch
    from trainstream.quantization import set_fp8_matmul
    with contextlib.ExitStack() as restore:
        if args.emulate_fp8 and not force_dequantize:
            restore.enter_context(emulated_fp8())
        model, cfg = build(args, device)
        if force_dequantize:
            set_fp8_matmul(model, "dequantize")  # what wrap()'s fp8_matmul option sets
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(cfg.vocab_size, (1, args.seq), generator=g).to(device)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR,
                                betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
        probes, hooks = probe_linears(model)
        losses: List[float] = []
        t0 = time.perf_counter()
        for step in range(args.steps):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(round(loss.item(), 4))
            print(f"  step {step + 1}/{args.steps}: loss {losses[-1]:.4f} "
                  f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
            if step == 0:
                for h in hooks:
                    h.remove()
                linears = {name: probe_result(ql, seen) for name, (ql, seen) in probes.items()}
                probes.clear()
        return {"losses": losses, "matmul_paths": matmul_paths(model), "linears": linears,
                "seconds": round(time.perf_counter() - t0, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8, help="blocks (the 14B scenario has 48)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="a small model (CPU smoke run)")
    ap.add_argument("--emulate-fp8", action="store_true",
                    help="the first arm takes the FP8 path in emulation (any device)")
    for name, what in (("hidden", "hidden_size"), ("intermediate", "intermediate_size"),
                       ("heads", "num_attention_heads"), ("kv-heads", "num_key_value_heads")):
        ap.add_argument(f"--{name}", type=int, help=f"the model's {what} (default: the 14B's)")
    ap.add_argument("--json", help="write the result here too")
    args = ap.parse_args(argv)
    for name in ("layers", "steps", "seq", "hidden", "intermediate", "heads", "kv_heads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            ap.error(f"--{name.replace('_', '-')} {value}: accepted 1 or more")
    import torch
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    doc = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "args": vars(args)}
    from trainstream.frozen.fp8_matmul import _fp8_probe
    # The path's own check of torch._scaled_mm: (usable, why, bias fused in its epilogue).
    doc["scaled_mm_probe"] = list(_fp8_probe(device))
    print(f"scaled_mm probe: {doc['scaled_mm_probe']}", file=sys.stderr, flush=True)
    for name, force in (("module", False), ("dequantize", True)):
        print(f"{name}: building {args.layers} blocks", file=sys.stderr, flush=True)
        doc[name] = arm(args, device, force)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print(f"{name:10s} paths {doc[name]['matmul_paths']}", file=sys.stderr)
        for lin, r in doc[name]["linears"].items():
            print(f"  {lin:28s} {r}", file=sys.stderr)
    print("step  module   dequantize")
    for i, (a, b) in enumerate(zip(doc["module"]["losses"], doc["dequantize"]["losses"]), 1):
        print(f"{i:4d}  {a:7.4f}  {b:7.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
