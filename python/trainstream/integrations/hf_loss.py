"""The causal-LM loss of a Hugging Face model without its full logits (TrainStreamTrainer's
``chunked_loss``).

The model runs as usual (its forward hooks, accelerate's autocast and wrap()'s pager
all see one top-level call) with ``logits_to_keep=1``, so its output head makes the
logits of the last position only, which the next-token loss never uses. A forward hook
on the decoder (``get_decoder()``) takes the last hidden state, and
``trainstream.losses.causal_lm_loss`` computes the loss from it and the head's weight
chunk by chunk. Why this and not a call of the decoder alone: that would bypass the
top-level forward, where wrap()'s pager starts each step and PEFT and accelerate put
their wrappers.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import TrainStreamError

# Config fields of models whose logits are more than ``lm_head(hidden)`` (Gemma 2's
# soft cap, Cohere's and Granite's scales): their loss is left to the model.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


@dataclass
class CausalLMHead:
    """Where a causal LM's last hidden state comes from and the head that reads it."""
    decoder: nn.Module
    head: nn.Linear
    verified: bool = False  # the first call compared the head's logits with ours


def _base_model(model: nn.Module) -> Optional[nn.Module]:
    """The transformers model under PEFT's wrapper (None: a PEFT method that changes the
    inputs, prompt learning, whose forward must not be bypassed)."""
    config = getattr(model, "peft_config", None)
    if isinstance(config, dict) and hasattr(model, "get_base_model"):
        active = config.get(getattr(model, "active_adapter", None))
        if active is None or getattr(active, "is_prompt_learning", False):
            return None
        return model.get_base_model()
    return model


def find_causal_lm_head(model: nn.Module) -> Optional[CausalLMHead]:
    """The decoder and output head of a Hugging Face causal LM (or a PEFT model over one)
    whose logits are exactly ``head(decoder output)`` and whose forward takes
    ``logits_to_keep``; None for any other model (its own loss is used)."""
    base = _base_model(model)
    if base is None or not type(base).__name__.endswith("ForCausalLM"):
        return None
    try:
        if "logits_to_keep" not in inspect.signature(base.forward).parameters:
            return None
        head = base.get_output_embeddings()
        decoder = base.get_decoder()
    except (AttributeError, ValueError, NotImplementedError):
        return None
    config = getattr(base, "config", None)
    if any(getattr(config, k, None) not in (None, 1, 1.0) for k in _LOGIT_TRANSFORMS):
        return None
    if not isinstance(head, nn.Linear) or not isinstance(decoder, nn.Module):
        return None
    return CausalLMHead(decoder, head)


def _hidden(output: Any) -> torch.Tensor:
    hidden = getattr(output, "last_hidden_state", None)
    return hidden if hidden is not None else output[0]


def chunked_causal_lm_loss(model: nn.Module, lm: CausalLMHead, inputs: Dict[str, Any],
                           num_items: Any, chunk_size: int) -> torch.Tensor:
    """``model``'s next-token loss on ``inputs`` (which hold ``labels``), from the last
    hidden state in chunks of ``chunk_size`` tokens. ``num_items``: the divisor
    Trainer counted over the accumulated micro-batches (None: the mean)."""
    from ..losses import causal_lm_loss
    inputs = dict(inputs)
    labels = inputs.pop("labels")
    captured = []
    handle = lm.decoder.register_forward_hook(lambda m, a, out: captured.append(_hidden(out)))
    try:
        outputs = model(**inputs, logits_to_keep=1)
    finally:
        handle.remove()
    if len(captured) != 1:
        raise TrainStreamError(
            f"chunked_loss: the decoder {type(lm.decoder).__name__} ran {len(captured)} times in "
            "one forward; pass trainstream={'chunked_loss': False} for this model")
    hidden = captured[0]
    weight, bias = lm.head.weight, lm.head.bias
    if not lm.verified:
        # One look at the last position: a model that transforms its logits after the
        # head (a soft cap, a scale not in its config) is caught here, not trained wrong.
        with torch.no_grad():
            ours = F.linear(hidden[:, -1:].to(weight.dtype), weight, bias).float()
            theirs = outputs.logits[:, -1:].float()
        if ours.shape != theirs.shape or not torch.allclose(ours, theirs, rtol=2e-2, atol=2e-2):
            raise TrainStreamError(
                f"chunked_loss: {type(model).__name__}'s logits are not its output head applied "
                "to the decoder's last hidden state; pass trainstream={'chunked_loss': False}")
        lm.verified = True
    return causal_lm_loss(hidden, weight, labels, bias, chunk_size=chunk_size,
                          num_items=num_items)


def workspace_bytes(lm: CausalLMHead, chunk_size: Optional[int],
                    compute_dtype: torch.dtype) -> int:
    """Device memory the chunked loss takes during one step and the memory planner does
    not see: a chunk's logits in the matmul dtype (and an fp32 copy where the fused
    kernels do not run: no Triton), the head's gradient (held from the loss's forward to
    its backward) when the head trains, and the head's weight cast to the matmul dtype
    when it is stored in another."""
    from .. import _ce_kernels
    from ..losses import DEFAULT_CHUNK_SIZE
    w = lm.head.weight
    vocab, hidden = w.shape
    elem = torch.empty((), dtype=compute_dtype).element_size()
    fp32_copy = 0 if _ce_kernels.triton is not None and w.is_cuda else 4
    total = (chunk_size or DEFAULT_CHUNK_SIZE) * vocab * (elem + fp32_copy)
    if w.requires_grad:
        total += vocab * hidden * w.element_size()
    if w.dtype != compute_dtype:
        total += vocab * hidden * elem
    return total
