"""Every option of ``wrap()`` and ``OffloadAdamW``: defaults and validation, in one place.

An unknown option, or a value outside what is accepted, raises ``ValueError``
naming the option and the accepted values. README.md's options table mirrors this.
"""
from __future__ import annotations

import math
import numbers
import os
from typing import Any, Dict

import torch

# name: (default, description of accepted values, validator)
_AUTO = "auto"


def _one_of(*choices):
    def check(v):
        return v in choices
    return check, ", ".join(repr(c) for c in choices)


def _positive_number_or_none(v):
    return v is None or (isinstance(v, numbers.Real) and not isinstance(v, bool) and v > 0)


def _positive_int(v):
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _positive_int_or_none(v):
    return v is None or _positive_int(v)


def _bool(v):
    return isinstance(v, bool)


def _device(v):
    if v is None:
        return True
    try:
        import torch
        torch.device(v)
        return True
    except (TypeError, RuntimeError, ValueError):
        return False


def _lr(v):
    return v is None or (isinstance(v, numbers.Real) and not isinstance(v, bool) and v >= 0)


def _offload(v):
    return v == _AUTO or v is True


def _str_or_none(v):
    return v is None or isinstance(v, str)


def _int_at_least(low):
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= low


def _fraction(v):
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and 0.0 <= v <= 1.0


def _block_policy(allow_list: bool):
    """'auto', True, False, a fraction of the blocks in [0, 1] or (allow_list) a list
    of block indices."""
    def check(v):
        if v == _AUTO or isinstance(v, bool):
            return True
        if allow_list and isinstance(v, (list, tuple)):
            return all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in v)
        return _fraction(v)
    return check


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 10**3, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6,
          "mib": 1 << 20, "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40, "tb": 10**12,
          "tib": 1 << 40}


def parse_bytes(v):
    """An int number of bytes, or a string such as '24GiB', '512M', '1.5 GB'; None if invalid."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v if v > 0 else None
    if isinstance(v, float):
        return int(v) if v >= 1 else None
    if not isinstance(v, str):
        return None
    import re
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", v)
    if not m or m.group(2).lower() not in _UNITS:
        return None
    n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    return n if n > 0 else None


def _bytes_or_none(v):
    return v is None or parse_bytes(v) is not None


_QUANT_FORMATS = ("int8", "nf4", "fp8", "nvfp4")
# How an FP8 base's forward multiplies (the option fp8_matmul; frozen/fp8_matmul.py's
# set_fp8_matmul): "auto" takes the tensor-core path wherever the probe accepts it
# (activations rounded to e4m3); "dequantize" runs the bf16 matmul on the dequantized
# weight (the stored codes exactly, as NF4 and INT8 do), with no second device copy of
# the weight.
FP8_MATMUL_MODES = ("auto", "dequantize")
# What the modes mean, in the errors of set_fp8_matmul and of wrap()'s option alike.
FP8_MATMUL_ACCEPTED = ("'auto' (an FP8 base's forward on FP8 tensor cores where the GPU and "
                       "torch run them right, activations rounded to e4m3) or 'dequantize' "
                       "(the bf16 matmul on the dequantized weight)")

# Spellings the reference API (TrainStream 0.5) accepts, mapped to the one value the
# rest of the package reads, so no other module compares against the aliases.
_ALIASES = {
    "quantize": {"none": None, False: None},
    "moment_dtype": {"fp32": "float32", "bf16": "bfloat16", torch.float32: "float32",
                     torch.bfloat16: "bfloat16"},
    "optimizer_mode": {},
}


def _normalise(name: str, value: Any) -> Any:
    aliases = _ALIASES.get(name)
    if not aliases or isinstance(value, (list, dict)):
        return value
    # False is a key, and 0 == False: only a bool may match a bool key.
    for key, target in aliases.items():
        if isinstance(key, bool) == isinstance(value, bool) and key is value or (
                not isinstance(key, bool) and not isinstance(value, bool) and _same(key, value)):
            return target
    return value


def _same(a: Any, b: Any) -> bool:
    try:
        return type(a) is type(b) and a == b
    except TypeError:
        return False


def _module_list_or_none(v):
    from torch import nn
    return v is None or (isinstance(v, (list, tuple, nn.ModuleList)) and len(v) >= 1
                         and all(isinstance(m, nn.Module) for m in v))


def _grad_pool(v):
    if isinstance(v, bool):
        return False
    if v == "auto" or (isinstance(v, int) and v >= 0):
        return True
    return isinstance(v, str) and parse_bytes(v) is not None


def _even_int_at_least_2(v):
    return isinstance(v, int) and not isinstance(v, bool) and v >= 2 and v % 2 == 0


OPTIONS: Dict[str, tuple] = {
    "optimizer_mode": ("auto", *_one_of("auto", "cpu", "gpu")[::-1]),
    "offload": ("auto", "'auto' or True", _offload),
    "moment_dtype": ("float32", "'float32' (or 'fp32', torch.float32), 'bfloat16' (or 'bf16', "
                     "torch.bfloat16) or 'auto'", _one_of("float32", "bfloat16", "auto")[0]),
    "max_grad_norm": (None, "None or a number > 0", _positive_number_or_none),
    "accumulation_steps": (1, "an integer >= 1", _positive_int),
    "guard_params": (True, "True or False", _bool),
    "threads": (None, "None (the daemon's pool) or an integer >= 1", _positive_int_or_none),
    "grad_pool": ("auto", "'auto', 0 (a gradient slot per parameter) or a size in bytes (an "
                  "integer or a string such as '256MiB')", lambda v: _grad_pool(v)),
    "device": (None, "None (leave the model where it is) or a torch device such as 'cuda'", _device),
    "lr": (None, "None (keep the optimizer's) or a number >= 0", _lr),
    "check_memory": (True, "True or False", _bool),
    "verbose": (False, "True or False", _bool),
    "free_grads": (False, "True or False (optimizer_mode='gpu': drop each gradient once its "
                   "update is enqueued)", _bool),
    "grad_post": ("backward", *_one_of("backward", "step")[::-1]),
    "socket": (None, "None (TRAINSTREAM_SOCKET or the default) or a path", _str_or_none),
    "job": (None, "None or a job name", _str_or_none),
    "seed": (0, "an integer >= 0", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0),
    "distributed": (None, "None (auto: data parallel when a torch.distributed process group has "
                    "more than one rank), True or False", lambda v: v is None or isinstance(v, bool)),
    "shared_state": (None, "None ($TRAINSTREAM_SHM, default 1), True (one optimizer state per "
                     "machine) or False (per-rank copies)", lambda v: v is None or isinstance(v, bool)),
    # Paging and the memory planner (docs/paging.md).
    "param_offload": ("auto", "'auto', True, False, a fraction in [0, 1] of the blocks, or a "
                      "list of block indices", _block_policy(True)),
    "activation_offload": ("auto", "'auto', True, False or a fraction in [0, 1] of the blocks",
                           _block_policy(False)),
    "recompute": ("auto", "'auto', True, False, a fraction in [0, 1] of the blocks, or a list of "
                  "block indices", _block_policy(True)),
    "prefetch_depth": (2, "an integer >= 1 (blocks, or saved tensors, fetched ahead)",
                       _int_at_least(1)),
    "min_offload_bytes": (1 << 20, "an integer >= 0 (smaller saved tensors stay on the device)",
                          _int_at_least(0)),
    "max_inflight_bytes": (None, "None (1 GiB or 10% of the device memory, whichever is "
                           "smaller) or an integer >= 1 (bytes of copies in flight each way)",
                           lambda v: v is None or _int_at_least(1)(v)),
    "max_activation_slowdown": (0.15, "a number >= 0 (fraction of step time activation paging "
                                "may add)",
                                lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool)
                                and v >= 0),
    "attention": ("auto", *_one_of("auto", "cudnn", "efficient", "flash", "math", None)[::-1]),
    "lm_loss": ("trainstream", "'trainstream' (a Hugging Face causal LM's loss_function computes "
                "the same loss without fp32 copies of the logits) or 'model' (its own)",
                _one_of("trainstream", "model")[0]),
    "vram_limit": (None, "None (TRAINSTREAM_VRAM_LIMIT, else the whole device), a number of "
                   "bytes > 0 or a string such as '24GiB'", _bytes_or_none),
    "vram_headroom": (0.10, "a number in [0, 0.9] (fraction of the device memory kept free)",
                      lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool)
                      and 0.0 <= v <= 0.9),
    "quantize": ("auto", "'auto', None (or 'none', False), " + ", ".join(map(repr, _QUANT_FORMATS)),
                 _one_of("auto", None, *_QUANT_FORMATS)[0]),
    "fp8_matmul": (None, "None (each FP8 layer as it is: 'auto' unless set_fp8_matmul changed "
                   "it), " + FP8_MATMUL_ACCEPTED, _one_of(None, *FP8_MATMUL_MODES)[0]),
    "quant_block_size": (64, "an even integer >= 2 (values per scale for int8 / nf4)",
                         _even_int_at_least_2),
    "blocks": (None, "None (find_blocks) or a list of the model's layer modules",
               _module_list_or_none),
    "profile": (True, "True (measure the PCIe bandwidth, or read the cached figure) or False "
                "(the planner uses no measured PCIe figure)", _bool),
    # OffloadAdamW's reference names (docs/options.md, "OffloadAdamW").
    "mode": (None, "None (optimizer_mode decides), 'cpu' or 'gpu'",
             lambda v: v is None or v in ("cpu", "gpu")),
    "compute_grad_norm": (False, "True or False", _bool),
    "chunk_elems": (None, "None (the daemon engine's own) or an integer >= 1",
                    _positive_int_or_none),
    "eager": (None, "None (grad_post decides), True (= grad_post='backward') or False "
              "(= grad_post='step')", lambda v: v is None or isinstance(v, bool)),
    "pin_moments": (None, "None (as the daemon is configured), True or False",
                    lambda v: v is None or isinstance(v, bool)),
    "prefer": ("exact", *_one_of("exact", "speed")[::-1]),
    "timeout_s": (60.0, "a number > 0 (seconds to wait on the daemon before DaemonError)",
                  lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool) and v > 0),
    "reconnect": (True, "True (after the daemon dies, wait up to timeout_s for one on the same "
                  "socket and resume the optimizer state it adopted: docs/recovery.md) or False "
                  "(DaemonError at once)", _bool),
}


def default(name: str) -> Any:
    """Option ``name``'s default, as the table has it (the one place defaults are written)."""
    return OPTIONS[name][0]


def check_value(name: str, value: Any) -> None:
    """Raises ValueError unless ``value`` is accepted for option ``name``."""
    _, accepted, check = OPTIONS[name]
    if not check(value):
        raise ValueError(f"option {name}={value!r} is not accepted; accepted: {accepted}")


def validate(options: Dict[str, Any]) -> Dict[str, Any]:
    """Returns ``options`` completed with defaults, or raises ValueError."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ValueError(
            f"unknown option(s) {', '.join(map(repr, unknown))}; accepted options: "
            f"{', '.join(sorted(OPTIONS))}")
    out = {}
    for name, spec in OPTIONS.items():
        value = _normalise(name, options.get(name, spec[0]))
        check_value(name, value)
        out[name] = value
    _merge_alias(out, options, "mode", "optimizer_mode", {"cpu": "cpu", "gpu": "gpu"})
    _merge_alias(out, options, "eager", "grad_post", {True: "backward", False: "step"})
    if out["max_inflight_bytes"] is None:
        out["max_inflight_bytes"] = default_inflight_bytes(out["device"])
    if out["vram_limit"] is None and os.environ.get("TRAINSTREAM_VRAM_LIMIT"):
        env = os.environ["TRAINSTREAM_VRAM_LIMIT"]
        if parse_bytes(env) is None:
            raise ValueError(f"TRAINSTREAM_VRAM_LIMIT={env!r} is not accepted; accepted: a "
                             "number of bytes > 0 or a string such as '24GiB'")
        out["vram_limit"] = env
    if out["vram_limit"] is not None:
        out["vram_limit"] = parse_bytes(out["vram_limit"])
    return out


def _merge_alias(out: Dict[str, Any], given: Dict[str, Any], alias: str, name: str,
                 mapping: Dict[Any, Any]) -> None:
    """The reference's ``alias`` and our ``name`` for one option: either may be given;
    both given and disagreeing is a ValueError."""
    if out[alias] is None:
        return
    wanted = mapping[out[alias]]
    if name in given and out[name] != wanted:
        raise ValueError(f"options {alias}={out[alias]!r} and {name}={out[name]!r} disagree "
                         f"({alias}={out[alias]!r} means {name}={wanted!r}); pass one of them")
    out[name] = wanted


def default_inflight_bytes(device) -> int:
    """``max_inflight_bytes=None``: 1 GiB or a tenth of the device's memory, whichever is
    smaller (1 GiB where there is no CUDA device to ask)."""
    gib = 1 << 30
    if not torch.cuda.is_available():
        return gib
    d = torch.device(device) if device is not None else torch.device("cuda")
    if d.type != "cuda":
        return gib
    index = d.index if d.index is not None else torch.cuda.current_device()
    return min(gib, torch.cuda.get_device_properties(index).total_memory // 10)


def check_adamw_hyper(lr, betas, eps, weight_decay, where: str = "") -> None:
    """AdamW's hyperparameters, as the daemon's engine accepts them (and finite)."""
    if torch.is_tensor(lr):
        raise ValueError(f"{where}lr as a tensor is not supported by OffloadAdamW; pass a float")
    # numbers.Real: numpy scalars too (a LambdaLR whose lambda returns np.float32).
    if not (isinstance(lr, numbers.Real) and not isinstance(lr, bool) and lr >= 0
            and math.isfinite(lr)):
        raise ValueError(f"{where}lr={lr!r}: accepted: a finite number >= 0")
    if not (len(betas) == 2 and all(0.0 <= b < 1.0 for b in betas)):
        raise ValueError(f"{where}betas={betas!r}: accepted: two numbers in [0, 1)")
    if not (eps > 0 and math.isfinite(eps)):
        raise ValueError(f"{where}eps={eps!r}: accepted: a finite number > 0")
    if not (weight_decay >= 0 and math.isfinite(weight_decay)):
        raise ValueError(f"{where}weight_decay={weight_decay!r}: accepted: a finite number >= 0")
