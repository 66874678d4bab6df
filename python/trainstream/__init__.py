"""TrainStream: PyTorch training offload to a per-machine daemon.

    import trainstream
    model, optimizer = trainstream.wrap(model, optimizer)

The optimizer's master weights, moments and AdamW update then live in the
``trainstreamd`` daemon's shared memory (one per machine; started on demand).

The package follows wrap()'s flow (docs/package-layout.md):

* ``api``: ``wrap``, ``unwrap``; ``report``: ``memory_report``, ``pinned_stats``,
  ``transfer_stats``; ``options``: every option, checked in one table; ``errors``;
  ``blocks``: the block stack;
* ``memory/``: measure (capacity), plan (the pure planner), adapt (the controller) and
  the install steps wrap() runs;
* ``streaming/``: weight paging, activation paging, the attention choice;
* ``optim/``: ``OffloadAdamW`` and its backends (daemon ring, zero-copy GPU, local),
  data parallel;
* ``frozen/``: quantized frozen weights and shared frozen bases;
* ``integrations/``: Hugging Face;
* ``_native/``: the compiled modules' loaders, the wire constants, pinning, copy streams.
"""
from .errors import DaemonError, NonFiniteGradientError, TrainStreamError
from .api import (TrainStreamSession, memory_report, pinned_stats, transfer_stats, unwrap,
                  wrap)
from .blocks import find_blocks
from .losses import causal_lm_loss, chunked_cross_entropy
from .memory.capacity import HardwareProfile, profile_hardware
from .optim import OffloadAdamW
from .optim.daemon_backend import DaemonBackend as GradientOffloader
from .optim.param_ready import ParamReadyHooks
from .streaming.activations import ActivationOffloader
from .streaming.weights import BlockPager as ParamPager
from ._native.runtime_check import check_torch as _check_torch

# GradientOffloader, ParamPager and ParamReadyHooks are the reference API's names for
# parts wrap() and OffloadAdamW build (the gradients' path to the daemon during
# backward; weight paging of the block stack; reads of a weight waiting for its
# in-flight update, guard_params); exported for inspection and isinstance checks, not
# meant to be constructed by hand.

__version__ = "0.1.0"  # the one place (CMakeLists.txt and pyproject.toml read it)

_check_torch()  # an installed package must run the torch it was built for (_C's ABI)
del _check_torch

__all__ = [
    "ActivationOffloader", "DaemonError", "NonFiniteGradientError", "OffloadAdamW", "TrainStreamError",
    "TrainStreamSession", "find_blocks", "memory_report", "pinned_stats", "transfer_stats",
    "unwrap", "wrap", "quantize_tensor", "quantize_model", "QuantizedTensor", "profile_hardware",
    "HardwareProfile", "ParamPager", "GradientOffloader", "ParamReadyHooks",
    "chunked_cross_entropy", "causal_lm_loss",
]


def __getattr__(name):
    # Quantization loads on first use (it pulls in _C's kernels).
    if name in ("quantize_tensor", "quantize_model", "QuantizedTensor"):
        from .frozen import quantization
        return getattr(quantization, name)
    raise AttributeError(f"module 'trainstream' has no attribute {name!r}")
