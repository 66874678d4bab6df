"""PEFT LoRA on TrainStream's quantized frozen weights (``QuantLinear``).

    import trainstream.integrations.huggingface   # or this module: registers the layer
    model = load_model(path, quantize="nf4")
    model = peft.get_peft_model(model, peft.LoraConfig(target_modules=[...]))

PEFT picks the LoRA layer for each target module from a list of dispatchers (its own
for ``nn.Linear``, bitsandbytes' ``Linear4bit``, HQQ, ...). ``QuantLinear`` is not on
that list, so this module puts one more dispatcher in front of it: a ``QuantLinear``
target becomes ``QuantLoraLinear`` (the frozen quantized base, plus PEFT's own
``lora_A``/``lora_B``, dropout, scaling and adapter bookkeeping), every other module goes
on to PEFT's list unchanged. The config's own ``_register_custom_module`` mapping still
comes first inside PEFT. Adapters save and load as PEFT's usual ``adapter_model``
files; merging dequantizes the base, adds the update and quantizes the sum again in the
base's format, as PEFT does for HQQ bases (the merged weight is rounded to that format).
"""
from __future__ import annotations

import warnings
from typing import Any, List, Optional

import torch
from torch import nn

from ..frozen.quantization import QuantLinear, quantize_tensor

__all__ = ["QuantLoraLinear", "dispatch_quant_linear", "register"]  # noqa: F822 (QuantLoraLinear: module __getattr__, built once peft is imported)

_registered = False


def _lora_layer_class():
    from peft.tuners.lora.layer import LoraLayer
    from peft.tuners.tuners_utils import check_adapters_to_merge

    class QuantLoraLinear(nn.Module, LoraLayer):
        """LoRA over a ``QuantLinear``: ``base(x) + lora_B(lora_A(dropout(x))) * scaling``."""

        def __init__(self, base_layer: QuantLinear, adapter_name: str, config, r: int = 0,
                     lora_alpha: int = 1, **kwargs: Any) -> None:
            if config.lora_bias:
                raise ValueError("lora_bias=True is not supported on a TrainStream QuantLinear "
                                 "base; accepted: lora_bias=False")
            if config.use_dora:
                raise ValueError("use_dora=True is not supported on a TrainStream QuantLinear "
                                 "base; accepted: use_dora=False (plain LoRA)")
            super().__init__()
            LoraLayer.__init__(self, base_layer)
            self.fan_in_fan_out = False
            self._active_adapter = adapter_name
            self.update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config, **kwargs)

        def _get_in_out_features(self, module):
            return module.in_features, module.out_features

        def resolve_lora_variant(self, *, config, **kwargs):
            return None

        def get_delta_weight(self, adapter: str) -> torch.Tensor:
            return (self.lora_B[adapter].weight @ self.lora_A[adapter].weight) * self.scaling[adapter]

        def _requantize(self, weight: torch.Tensor) -> None:
            old = self.get_base_layer()
            bias = old.bias
            new = QuantLinear(quantize_tensor(weight.to(old.weight_dtype), old.format,
                                              old.block_size), bias)
            if bias is not None:
                new.bias = bias  # the same parameter (trained or not), not a copy
            new.set_fp8_matmul(old.fp8_matmul)  # as wrap() or the user set it
            new.set_paged(old._paged)  # as the weight pager left it
            self.base_layer = new

        def merge(self, safe_merge: bool = False, adapter_names: Optional[List[str]] = None) -> None:
            adapter_names = check_adapters_to_merge(self, adapter_names)
            if not adapter_names:
                return
            warnings.warn("merging LoRA into a quantized TrainStream base dequantizes it, adds "
                          "the update and quantizes the sum again: the merged weight is rounded "
                          "to the base's format", UserWarning, stacklevel=2)
            for name in adapter_names:
                if name not in self.lora_A:
                    continue
                base = self.get_base_layer()
                w = base.qweight.dequantize(torch.float32)
                w = w + self.get_delta_weight(name).float().to(w.device)
                if safe_merge and not torch.isfinite(w).all():
                    raise ValueError(f"NaNs in the merged weights: adapter {name!r} looks broken")
                self._requantize(w)
                self.merged_adapters.append(name)

        def unmerge(self) -> None:
            if not self.merged:
                warnings.warn("Already unmerged. Nothing to do.", UserWarning, stacklevel=2)
                return
            while self.merged_adapters:
                name = self.merged_adapters.pop()
                if name not in self.lora_A:
                    continue
                base = self.get_base_layer()
                w = base.qweight.dequantize(torch.float32)
                self._requantize(w - self.get_delta_weight(name).float().to(w.device))

        def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            self._check_forward_args(x, *args, **kwargs)
            if kwargs.pop("adapter_names", None) is not None:
                raise ValueError("adapter_names (mixed-adapter batches) is not supported on a "
                                 "TrainStream QuantLinear base")
            if self.disable_adapters:
                if self.merged:
                    self.unmerge()
                return self.base_layer(x, *args, **kwargs)
            result = self.base_layer(x, *args, **kwargs)
            if self.merged:
                return result
            for name in self.active_adapters:
                if name not in self.lora_A:
                    continue
                lora_A, lora_B = self.lora_A[name], self.lora_B[name]
                convert = not torch.is_autocast_enabled(x.device.type)
                expected = result.dtype
                xa = self._cast_input_dtype(x, lora_A.weight.dtype) if convert else x
                update = lora_B(lora_A(self.lora_dropout[name](xa))) * self.scaling[name]
                result = result + (update.to(expected) if convert else update)
            return result

        def __repr__(self) -> str:
            return "lora." + super().__repr__()

    return QuantLoraLinear


_CLASS = None


def __getattr__(name: str):
    if name == "QuantLoraLinear":
        return _layer()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _layer():
    global _CLASS
    if _CLASS is None:
        _CLASS = _lora_layer_class()
    return _CLASS


def dispatch_quant_linear(target: nn.Module, adapter_name: str, config, **kwargs):
    """PEFT's dispatcher contract: a ``QuantLoraLinear`` for a ``QuantLinear`` target
    (or one already wrapped by PEFT), else None."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    base = target.get_base_layer() if isinstance(target, BaseTunerLayer) else target
    if isinstance(base, QuantLinear):
        return _layer()(base, adapter_name, config=config, **kwargs)
    return None


def register() -> bool:
    """Puts ``dispatch_quant_linear`` in front of PEFT's LoRA dispatchers (once; later
    calls do nothing). Returns False when PEFT is not installed."""
    global _registered
    if _registered:
        return True
    try:
        from peft.tuners.lora import model as lora_model
    except ImportError:
        return False
    original = lora_model.LoraModel._create_new_module
    if getattr(original, "_trainstream", False):
        _registered = True
        return True

    def _create_new_module(lora_config, adapter_name, target, **kwargs):
        # A config's own custom-module mapping (PEFT's documented hook) keeps precedence.
        custom = getattr(lora_config, "_custom_modules", None) or {}
        base = target.get_base_layer() if hasattr(target, "get_base_layer") else target
        if not any(isinstance(base, k) for k in custom):
            new = dispatch_quant_linear(target, adapter_name, lora_config, **kwargs)
            if new is not None:
                return new
        return original(lora_config, adapter_name, target, **kwargs)

    _create_new_module._trainstream = True
    lora_model.LoraModel._create_new_module = staticmethod(_create_new_module)
    _registered = True
    return True


register()
