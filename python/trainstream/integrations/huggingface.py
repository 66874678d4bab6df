"""Hugging Face models over a frozen base shared through the daemon.

    from trainstream.integrations.huggingface import load_model
    model = load_model("/models/Qwen2.5-14B", quantize="nf4")

The model is built from the folder's ``config.json`` with its parameters on the
meta device (no weight memory), its block-stack linear weights are bound to the
daemon's shared base (read-only views; ``QuantLinear`` modules over views when
quantized), and the rest (embeddings, norms, output layer, biases) is copied in
as ordinary trainable parameters. See docs/base-cache.md.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn

from ..blocks import find_block_stack, find_blocks
from ..frozen.quantization import QuantLinear, _check_block_size
from ..frozen.load_progress import check_progress
from ..frozen.shared_base import SharedBase, check_load_threads, load_base
from ..memory.capacity import ram_available
from . import peft as _peft_lora  # noqa: F401 (registers QuantLinear as a PEFT LoRA target)

__all__ = ["load_model", "resolve_quantize", "wrap_hf"]  # and the Trainer names, below


def __getattr__(name: str):
    # TrainStreamTrainer and TrainStreamCallback subclass transformers' Trainer classes:
    # imported on first use, so that load_model() does not pull in the Trainer stack.
    if name == "TrainStreamTrainer":
        from .hf_trainer import TrainStreamTrainer
        return TrainStreamTrainer
    if name == "TrainStreamCallback":
        from .hf_callback import TrainStreamCallback
        return TrainStreamCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def decoder_layers(model: nn.Module):
    """The decoder layers of a Hugging Face model (or a PEFT model over one): the block
    stack of its ``get_decoder()`` (``model.model.layers`` for Llama and Qwen2), or of
    the whole model when it has no decoder to ask for. [] when there is none."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    try:
        decoder = base.get_decoder()
    except (AttributeError, ValueError, NotImplementedError):
        decoder = None
    blocks = find_blocks(decoder) if isinstance(decoder, nn.Module) else []
    return blocks or find_blocks(model)


def wrap_hf(model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, **options):
    """``trainstream.wrap()`` for a Hugging Face model, with ``blocks`` preset to its
    decoder layers (``decoder_layers``), so that paging and activation offload take
    those even where another list of layers is longer (a vision tower). A ``blocks``
    option given is used as it is."""
    from .. import options as _options
    from ..api import wrap
    if "blocks" not in options and "blocks" in _options.OPTIONS:
        layers = decoder_layers(model)
        if layers:
            options["blocks"] = list(layers)
    return wrap(model, optimizer, **options)

QUANTIZE_CHOICES = ("auto", "none", "int8", "nf4", "fp8", "nvfp4")


def resolve_quantize(quantize: Optional[str], block_numel: int, other_numel: int,
                     block_size: int = 64, ram_fraction: float = 0.85,
                     available: Optional[int] = None) -> str:
    """The format ``load_model`` uses. ``"auto"``: "none" when the weights in bf16
    fit in ``ram_fraction`` of available RAM, else "int8" if that fits, else "nf4"
    (only the block-stack linear weights are quantized; the rest stays bf16)."""
    if quantize is None or quantize is False:
        return "none"
    if not isinstance(quantize, str) or quantize not in QUANTIZE_CHOICES:
        raise ValueError(f"quantize={quantize!r}: use one of {', '.join(QUANTIZE_CHOICES)}, "
                         "None or False")
    if quantize != "auto":
        return quantize
    if isinstance(ram_fraction, bool) or not isinstance(ram_fraction, (int, float)) \
            or not 0 < ram_fraction <= 1:
        raise ValueError(f"ram_fraction={ram_fraction!r}: use a number in (0, 1]")
    limit = ram_fraction * (available if available is not None else ram_available())
    rest = 2 * other_numel
    scale_bytes = 4 * -(-block_numel // block_size)
    for fmt, nbytes in (("none", 2 * block_numel), ("int8", block_numel + scale_bytes),
                        ("nf4", -(-block_numel // 2) + scale_bytes)):
        if rest + nbytes <= limit:
            return fmt
    return "nf4"


@contextlib.contextmanager
def _parameters_on_meta():
    """Parameters created inside go to the meta device as they are registered
    (their CPU storage was only reserved by torch.empty, never touched); buffers
    stay real, so e.g. rotary ``inv_freq`` is computed as usual."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = type(param)(param.to("meta"),
                                                   requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _resolve_path(name_or_path: str, random_weights: bool) -> Tuple[str, str]:
    """(config folder, checkpoint path: a folder or one .safetensors file)."""
    if os.path.isdir(name_or_path):
        return name_or_path, name_or_path
    if os.path.isfile(name_or_path):
        if not name_or_path.endswith(".safetensors"):
            raise ValueError(f"{name_or_path}: give a model folder or a .safetensors file")
        return os.path.dirname(os.path.abspath(name_or_path)), name_or_path
    if name_or_path.startswith(("/", "./", "../")):
        raise FileNotFoundError(f"{name_or_path}: no such model folder or file")
    # A hub id: download what is needed (the config only, for random weights).
    try:
        import huggingface_hub
    except ImportError:
        raise ValueError(f"{name_or_path!r} is not a local folder and huggingface_hub is not "
                         "installed to download it") from None
    patterns = ["*.json"] if random_weights else ["*.json", "*.safetensors"]
    try:
        folder = huggingface_hub.snapshot_download(name_or_path, allow_patterns=patterns)
    except Exception as e:  # noqa: BLE001 (offline, unknown repo, no access: say which)
        raise ValueError(f"cannot download {name_or_path!r} from the Hugging Face hub "
                         f"({type(e).__name__}: {e}); pass a local folder instead") from None
    return folder, folder


def _build_on_meta(config, dtype: torch.dtype, trust_remote_code: bool) -> nn.Module:
    import transformers
    auto = transformers.AutoModelForCausalLM
    archs = getattr(config, "architectures", None) or []
    if archs and not any(a.endswith("ForCausalLM") for a in archs):
        auto = transformers.AutoModel
    with _parameters_on_meta():
        try:
            model = auto.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
        except TypeError:
            model = auto.from_config(config, torch_dtype=dtype,
                                     trust_remote_code=trust_remote_code)
    return model


def _block_linears(model: nn.Module):
    """(parent, child name, Linear, full name) of every Linear in the block stack."""
    prefix, blocks = find_block_stack(model)
    if not blocks:
        return []
    out = []
    for i, block in enumerate(blocks):
        for mod_name, m in block.named_modules():
            for child_name, child in m.named_children():
                if isinstance(child, nn.Linear):
                    full = ".".join(x for x in (prefix, str(i), mod_name, child_name) if x)
                    out.append((m, child_name, child, full))
    return out


def _set_param(model: nn.Module, name: str, value: torch.Tensor, requires_grad: bool):
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    owner._parameters[attr] = nn.Parameter(value, requires_grad=requires_grad)


def _bind_to_base(model: nn.Module, base: SharedBase, dtype: torch.dtype,
                  device: Optional[torch.device] = None) -> Dict[str, int]:
    """Binds the block-stack Linears to views of the base: of its host mapping, or of
    its VRAM copy on ``device`` (share_vram). Everything else is copied from the host
    mapping."""
    stats = {"shared_quantized": 0, "shared_views": 0, "copied": 0, "shared_bytes": 0}
    for parent, child_name, lin, name in _block_linears(model):
        key = f"{name}.weight"
        if key not in base.entries:
            continue  # left for the generic pass (which reports it missing)
        bias = None
        if lin.bias is not None:
            bias = base.dequantized(f"{name}.bias", dtype)
        if base.is_quantized(key):
            q = base.quantized(key, device)
            if tuple(q.shape) != tuple(lin.weight.shape):
                raise ValueError(f"{key}: the checkpoint has shape {tuple(q.shape)}, the model "
                                 f"{tuple(lin.weight.shape)} (config and weights disagree)")
            module = QuantLinear(q, nn.Parameter(bias, requires_grad=lin.bias.requires_grad)
                                 if bias is not None else None)
            setattr(parent, child_name, module)
            stats["shared_quantized"] += 1
            stats["shared_bytes"] += q.nbytes
            continue
        w = base.tensor(key, device)
        if tuple(w.shape) != tuple(lin.weight.shape):
            raise ValueError(f"{key}: the checkpoint has shape {tuple(w.shape)}, the model "
                             f"{tuple(lin.weight.shape)} (config and weights disagree)")
        if w.dtype != dtype:
            w = w.to(dtype)  # a private copy: the shared bytes are in another dtype
            stats["copied"] += 1
        else:
            stats["shared_views"] += 1
            stats["shared_bytes"] += w.numel() * w.element_size()
        lin._parameters["weight"] = nn.Parameter(w, requires_grad=False)
        if bias is not None:
            lin._parameters["bias"] = nn.Parameter(bias, requires_grad=lin.bias.requires_grad)
    for name, p in list(model.named_parameters(remove_duplicate=False)):
        if not p.is_meta or name not in base.entries:
            continue  # tied weights are re-tied below; anything else is reported then
        value = base.dequantized(name, dtype) if p.is_floating_point() else \
            base.tensor(name).clone()
        if tuple(value.shape) != tuple(p.shape):
            raise ValueError(f"{name}: the checkpoint has shape {tuple(value.shape)}, the model "
                             f"{tuple(p.shape)} (config and weights disagree)")
        _set_param(model, name, value, p.requires_grad)
        stats["copied"] += 1
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    still = [n for n, p in model.named_parameters(remove_duplicate=False) if p.is_meta]
    if still:
        shown = ", ".join(still[:8]) + (f" (and {len(still) - 8} more)" if len(still) > 8 else "")
        raise ValueError(f"the checkpoint {base.info['path']} has no weights for {shown}")
    for name, b in model.named_buffers():
        if b.is_meta:
            raise ValueError(f"buffer {name} is still on the meta device")
    return stats


def _random_init(model: nn.Module, dtype: torch.dtype, std: float) -> None:
    """Materializes meta parameters with random values (benchmarks: no checkpoint)."""
    gen = torch.Generator().manual_seed(0)
    for name, p in list(model.named_parameters(remove_duplicate=False)):
        if not p.is_meta:
            continue
        t = torch.empty(p.shape, dtype=dtype)
        if p.dim() == 1:
            t.fill_(1.0 if name.endswith("weight") else 0.0)
        else:
            t.normal_(0.0, std, generator=gen)
        _set_param(model, name, t, p.requires_grad)
    if hasattr(model, "tie_weights"):
        model.tie_weights()


def load_model(name_or_path: str, quantize: Optional[str] = "auto",
               dtype: torch.dtype = torch.bfloat16, quant_block_size: int = 64,
               random_weights: bool = False, ram_fraction: float = 0.85,
               trust_remote_code: bool = False, *, share_vram: Any = False,
               socket: Optional[str] = None, progress: Any = "auto",
               load_threads: Optional[int] = None, **config_overrides: Any) -> nn.Module:
    """A Hugging Face model whose frozen block weights are the daemon's shared base.

    Args:
        name_or_path: a local model folder (``config.json`` plus safetensors
            shards), a ``.safetensors`` file beside a ``config.json``, or a hub id
            (downloaded with ``huggingface_hub`` when the machine can reach the hub).
        quantize: "auto" (the smallest of none / int8 / nf4 that is needed to fit
            ``ram_fraction`` of available RAM), "none" (also None or False), "int8",
            "nf4", "fp8", "nvfp4".
            Only the block-stack linear weights are quantized.
        dtype: dtype of the unquantized weights (embeddings, norms, output layer).
        quant_block_size: int8 / nf4 block size (even, >= 2).
        random_weights: build random weights instead of reading a checkpoint (for
            benchmarks: needs only the config; nothing is shared through the daemon).
        ram_fraction: share of available RAM "auto" may fill.
        trust_remote_code: passed to ``transformers``.
        share_vram: False, or a CUDA device (True: the current one). The daemon keeps
            one copy of the base in that GPU's memory for every process that asks
            (CUDA IPC); the block-stack weights are views of it and the model is
            returned on that device, its other weights copied there. Each process's
            own VRAM then grows only by those copies, what it trains and activations.
        socket: the daemon's socket (default: as ``trainstream.wrap``).
        progress: "auto" (a bar on stderr while the daemon reads, when stderr is a
            terminal: tqdm's, else a plain line), True (always), False/None, or a
            callable ``progress(bytes_read, bytes_total, tensors_done, tensors_total)``.
        load_threads: threads the daemon reads and quantizes the checkpoint on
            (None: its ``load_threads`` setting, by default one per available CPU).
        **config_overrides: set on the config before the model is built
            (e.g. ``num_hidden_layers=2``).

    The block-stack linear weights are frozen (``requires_grad=False``) views of the
    shared read-only base; writing to them in place faults. The rest are ordinary
    trainable parameters. The model holds the base as ``model.trainstream_base``
    (and its daemon session): the base stays referenced while the model lives.
    """
    check_load_threads(load_threads, "load_threads")
    check_progress(progress)
    vram_device = None
    if share_vram is not False and share_vram is not None:
        from ..frozen.shared_base import _cuda_device
        vram_device = _cuda_device(share_vram)
        if random_weights:
            raise ValueError("share_vram needs a checkpoint: random_weights=True builds a "
                             "private model and shares nothing")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype={dtype!r}: use a floating torch dtype (e.g. torch.bfloat16)")
    quant_block_size = _check_block_size(quant_block_size)
    if not isinstance(name_or_path, (str, os.PathLike)) or not str(name_or_path):
        raise ValueError(f"name_or_path={name_or_path!r}: give a model folder or hub id")
    if quantize is False:
        quantize = None  # as "none": the reference API's spelling
    if quantize is not None and (not isinstance(quantize, str) or quantize not in QUANTIZE_CHOICES):
        raise ValueError(f"quantize={quantize!r}: use one of {', '.join(QUANTIZE_CHOICES)}, "
                         "None or False")
    import transformers

    config_dir, checkpoint = _resolve_path(str(name_or_path), random_weights)
    config = transformers.AutoConfig.from_pretrained(config_dir,
                                                     trust_remote_code=trust_remote_code)
    for k, v in config_overrides.items():
        if not hasattr(config, k):
            raise ValueError(f"config has no field {k!r} (config_overrides must name fields "
                             f"of {type(config).__name__})")
        setattr(config, k, v)
    model = _build_on_meta(config, dtype, trust_remote_code)
    block_numel = sum(lin.weight.numel() for _, _, lin, _ in _block_linears(model))
    all_numel = sum(p.numel() for p in model.parameters())
    fmt = resolve_quantize(quantize, block_numel, all_numel - block_numel, quant_block_size,
                           ram_fraction)
    if random_weights:
        _random_init(model, dtype, float(getattr(config, "initializer_range", 0.02)))
        frozen = [lin for _, _, lin, _ in _block_linears(model)]
        for lin in frozen:
            lin.weight.requires_grad_(False)
        if fmt != "none":
            from ..frozen.quantization import quantize_model
            quantize_model(model, fmt, block_size=quant_block_size)
        model.trainstream_load = {"format": fmt, "random_weights": True}
        return model.eval()
    base = load_base(os.path.abspath(checkpoint), fmt, quant_block_size, socket=socket,
                     job="load_model", progress=progress, threads=load_threads,
                     share_vram=vram_device if vram_device is not None else False)
    try:
        stats = _bind_to_base(model, base, dtype, vram_device)
        if vram_device is not None:
            model.to(vram_device)  # the shared views are there already: copies the rest
    except Exception:
        base.release()
        raise
    model.trainstream_base = base
    model.trainstream_load = {"format": fmt, "random_weights": False, **stats,
                              "vram_device": str(vram_device) if vram_device else None}
    return model.eval()
