"""Every option of ``wrap()`` and ``OffloadAdamW``: defaults and validation, in one place.

An unknown option, or a value outside what is accepted, raises ``ValueError``
naming the option and the accepted values. README.md's options table mirrors this.
"""
from __future__ import annotations

import numbers
from typing import Any, Dict

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


OPTIONS: Dict[str, tuple] = {
    "optimizer_mode": ("auto", *_one_of("auto", "cpu", "gpu")[::-1]),
    "offload": ("auto", "'auto' or True", _offload),
    "moment_dtype": ("float32", *_one_of("float32", "bfloat16", "auto")[::-1]),
    "max_grad_norm": (None, "None or a number > 0", _positive_number_or_none),
    "accumulation_steps": (1, "an integer >= 1", _positive_int),
    "guard_params": (True, "True or False", _bool),
    "threads": (None, "None (the daemon's pool) or an integer >= 1", _positive_int_or_none),
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
    "timeout_s": (60.0, "a number > 0 (seconds to wait on the daemon before DaemonError)",
                  lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool) and v > 0),
}


def validate(options: Dict[str, Any]) -> Dict[str, Any]:
    """Returns ``options`` completed with defaults, or raises ValueError."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ValueError(
            f"unknown option(s) {', '.join(map(repr, unknown))}; accepted options: "
            f"{', '.join(sorted(OPTIONS))}")
    out = {}
    for name, (default, accepted, check) in OPTIONS.items():
        value = options.get(name, default)
        if not check(value):
            raise ValueError(f"option {name}={value!r} is not accepted; accepted: {accepted}")
        out[name] = value
    return out
