"""What compare.py trains: five scenarios on random-weight models with Qwen2.5's
published shapes, one checkpoint per shape written once per run, and the batch.

Every engine of a scenario reads the same checkpoint (``from_pretrained`` of it, or
TrainStream's ``load_model``), trains on the same batch of random tokens (seed 1; the
same batch every step, so a falling loss shows the engine trains) with the same
learning rate and, for LoRA, the same adapters (r=16, alpha 32, no dropout, all seven
projections).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from dataclasses import dataclass
from typing import Dict, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(HERE)
for sub in ("base", "paging", "huggingface"):
    if os.path.join(BENCH, sub) not in sys.path:
        sys.path.insert(0, os.path.join(BENCH, sub))

from bench_paging import SHAPES as _PAGING_SHAPES  # noqa: E402 (7b, 14b, 32b)
from bench_paging import TINY as _TINY  # noqa: E402
from bench_trainer import SHAPES as _TRAINER_SHAPES  # noqa: E402 (1.5b)

LORA = dict(r=16, lora_alpha=32, lora_dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                            "down_proj"])
LR = {"full": 2e-5, "lora": 2e-4}
_HF_TO_SHORT = {"hidden_size": "hidden", "intermediate_size": "intermediate",
                "num_hidden_layers": "layers", "num_attention_heads": "heads",
                "num_key_value_heads": "kv_heads", "vocab_size": "vocab",
                "tie_word_embeddings": "tie_word_embeddings"}


def _short(shape: dict, vocab: int = 152064) -> dict:
    out = {_HF_TO_SHORT[k]: v for k, v in shape.items()}
    out.setdefault("vocab", vocab)
    return out


SHAPES = {"1.5b": _short(_TRAINER_SHAPES["1.5b"]),
          **{size: _short(_PAGING_SHAPES[size]) for size in ("7b", "14b", "32b")}}
TINY_VOCAB = 512


@dataclass(frozen=True)
class Scenario:
    name: str
    size: str            # a key of SHAPES
    kind: str            # "full" (every weight trained) or "lora" (adapters on a frozen base)
    batch: int
    seq: int
    param_dtype: str     # the dtype the model is loaded in: "float32" or "bfloat16"

    @property
    def lr(self) -> float:
        return LR[self.kind]

    def shape(self, tiny: bool) -> dict:
        if not tiny:
            return dict(SHAPES[self.size])
        shape = _short(_TINY, TINY_VOCAB)
        shape["tie_word_embeddings"] = SHAPES[self.size].get("tie_word_embeddings", False)
        return shape

    def tokens(self, tiny: bool) -> Tuple[int, int]:
        """(batch, sequence length); --tiny: at most 2 x 32 (x 64 for the 2k case)."""
        if tiny:
            return min(self.batch, 2), 64 if self.seq > 1024 else 32
        return self.batch, self.seq


SCENARIOS: Dict[str, Scenario] = {s.name: s for s in (
    # bf16 autocast over fp32 weights: the usual mixed-precision full fine-tune.
    Scenario("full1.5b", "1.5b", "full", 4, 1024, "float32"),
    # bf16 weights (fp32 ones would need ~120 GB with AdamW's state on the GPU).
    Scenario("full7b", "7b", "full", 1, 1024, "bfloat16"),
    Scenario("lora14b", "14b", "lora", 1, 512, "bfloat16"),
    Scenario("lora14b_2k", "14b", "lora", 1, 2048, "bfloat16"),
    Scenario("lora32b", "32b", "lora", 1, 512, "bfloat16"),
)}


def parse_scenarios(text: str):
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in SCENARIOS]
    if bad or not names:
        raise ValueError(f"--scenarios {text!r}: unknown {', '.join(map(repr, bad)) or '(none given)'}; "
                         f"accepted: {', '.join(SCENARIOS)} (comma-separated)")
    return [SCENARIOS[n] for n in names]


def param_count(shape: dict) -> int:
    """Parameters of a Qwen2 model of ``shape`` (short keys), counted from the shape
    (a 4-bit or sharded model's tensors do not show their true element count)."""
    h, i, v = shape["hidden"], shape["intermediate"], shape["vocab"]
    kv = shape["kv_heads"] * (h // shape["heads"])
    layer = (h * h + h) + 2 * (kv * h + kv) + h * h + 3 * h * i + 2 * h
    head = 0 if shape.get("tie_word_embeddings") else v * h
    return v * h + shape["layers"] * layer + h + head


def lora_param_count(shape: dict, r: int = LORA["r"]) -> int:
    """Adapter parameters of LORA (r x in + out x r per projection, every layer)."""
    h, i = shape["hidden"], shape["intermediate"]
    kv = shape["kv_heads"] * (h // shape["heads"])
    pairs = [(h, h), (h, kv), (h, kv), (h, h), (h, i), (h, i), (i, h)]
    return shape["layers"] * sum(r * (a + b) for a, b in pairs)


def ensure_checkpoint(scenario: Scenario, tiny: bool, root: str, log=print) -> str:
    """The random-weight checkpoint of the scenario's shape under ``root`` (written by
    bench_base_load.write_checkpoint, with a tokenizer beside it for the engines that
    load one): reused when a folder with the same config exists."""
    from bench_base_load import write_checkpoint
    shape = scenario.shape(tiny)
    folder = os.path.join(root, f"qwen2.5-{scenario.size}{'-tiny' if tiny else ''}-random")
    config = os.path.join(folder, "config.json")
    if os.path.exists(config) and os.path.exists(os.path.join(folder, "tokenizer.json")):
        with open(config) as f:
            have = json.load(f)
        if all(have.get(k) == shape[s] for k, s in _HF_TO_SHORT.items() if s in shape):
            log(f"checkpoint {folder}: reused")
            with open(os.path.join(folder, "tokenizer.json")) as f:
                if "<|fim_pad|>" not in f.read():  # written before the pad token
                    write_tokenizer(folder, shape["vocab"])
            return folder
    with contextlib.redirect_stdout(sys.stderr):  # stdout may be --live's JSON lines
        write_checkpoint(argparse.Namespace(shard_gb=4.0, **shape), folder)
    write_tokenizer(folder, shape["vocab"])
    return folder


def write_tokenizer(folder: str, vocab: int) -> None:
    """A word-level tokenizer with one entry per token id ("t0" ..., then Qwen2.5's
    end-of-text token and its `<|fim_pad|>`), so ``len(tokenizer)`` equals the model's
    vocabulary: engines that load a tokenizer with the model (Unsloth) find one and
    resize nothing. The pad token is a pad-named special token distinct from the end of
    text, as in Qwen2.5's own tokenizer: Unsloth refuses a pad equal to the eos when no
    reserved pad token exists (its ``fix_pad_token``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    eos, pad = "<|endoftext|>", "<|fim_pad|>"
    table = {f"t{i}": i for i in range(vocab - 2)}
    table[eos], table[pad] = vocab - 2, vocab - 1
    tok = Tokenizer(models.WordLevel(table, unk_token=eos))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=pad,
                            unk_token=eos).save_pretrained(folder)


def batch_ids(scenario: Scenario, tiny: bool, vocab: int, device):
    """The one batch every engine trains on: random tokens, seed 1."""
    import torch
    batch, seq = scenario.tokens(tiny)
    g = torch.Generator().manual_seed(1)
    return torch.randint(vocab, (batch, seq), generator=g).to(device)
