"""TrainStream: PyTorch training offload to a per-machine daemon.

    import trainstream
    model, optimizer = trainstream.wrap(model, optimizer)

The optimizer's master weights, moments and AdamW update then live in the
``trainstreamd`` daemon's shared memory (one per machine; started on demand).

The package follows wrap()'s flow (docs/package-layout.md):

* ``api``: ``wrap``, ``unwrap``, ``memory_report``; ``options``: every option, checked
  in one table; ``errors``; ``blocks``: the block stack;
* ``memory/``: measure (capacity), plan (the pure planner), adapt (the controller) and
  the install steps wrap() runs;
* ``streaming/``: weight paging, activation paging, the attention choice;
* ``optim/``: ``OffloadAdamW`` and its backends (daemon ring, zero-copy GPU, local),
  data parallel;
* ``losses``: ``chunked_cross_entropy``, ``causal_lm_loss`` (the logits never built whole);
* ``frozen/``: quantized frozen weights and shared frozen bases;
* ``integrations/``: Hugging Face;
* ``_native/``: the compiled modules' loaders, the wire constants, pinning, copy streams.
"""
from .errors import DaemonError, NonFiniteGradientError, TrainStreamError
from .api import (TrainStreamSession, memory_report, pinned_stats, transfer_stats, unwrap,
                  wrap)
from .blocks import find_blocks
from .losses import causal_lm_loss, chunked_cross_entropy
from .optim import OffloadAdamW
from .streaming.activations import ActivationOffloader

__version__ = "0.1.0"

__all__ = [
    "ActivationOffloader", "DaemonError", "NonFiniteGradientError", "OffloadAdamW", "TrainStreamError",
    "TrainStreamSession", "causal_lm_loss", "chunked_cross_entropy", "find_blocks",
    "memory_report", "pinned_stats", "transfer_stats",
    "unwrap", "wrap", "quantize_tensor", "quantize_model", "QuantizedTensor", "profile_hardware",
]


def __getattr__(name):
    # Quantization and hardware profiling load on first use (they pull in _C's kernels).
    if name in ("quantize_tensor", "quantize_model", "QuantizedTensor"):
        from .frozen import quantization
        return getattr(quantization, name)
    if name == "profile_hardware":
        from .memory.capacity import profile_hardware
        return profile_hardware
    raise AttributeError(f"module 'trainstream' has no attribute {name!r}")
