"""TrainStream: PyTorch training offload to a per-machine daemon.

    import trainstream
    model, optimizer = trainstream.wrap(model, optimizer)

The optimizer's master weights, moments and AdamW update then live in the
``trainstreamd`` daemon's shared memory (one per machine; started on demand).
"""
from .errors import DaemonError, NonFiniteGradientError, TrainStreamError
from .activations import ActivationOffloader
from .optim import OffloadAdamW
from .wrap import (TrainStreamSession, find_blocks, memory_report, pinned_stats, transfer_stats,
                   unwrap, wrap)

__version__ = "0.1.0"

__all__ = [
    "ActivationOffloader", "DaemonError", "NonFiniteGradientError", "OffloadAdamW", "TrainStreamError",
    "TrainStreamSession", "find_blocks", "memory_report", "pinned_stats", "transfer_stats",
    "unwrap", "wrap", "quantize_tensor", "quantize_model", "QuantizedTensor", "profile_hardware",
]


def __getattr__(name):
    # Quantization and hardware profiling load on first use (they pull in _C's kernels).
    if name in ("quantize_tensor", "quantize_model", "QuantizedTensor"):
        from . import quantization
        return getattr(quantization, name)
    if name == "profile_hardware":
        from .hardware import profile_hardware
        return profile_hardware
    raise AttributeError(f"module 'trainstream' has no attribute {name!r}")
