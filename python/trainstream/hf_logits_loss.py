"""A Hugging Face causal LM's own loss, without fp32 copies of its logits.

transformers' ``ForCausalLMLoss`` upcasts the logits to fp32 before the cross-entropy:
for 4 x 1,024 tokens of a 152k vocabulary that is a 2.3 GiB copy, another 2.3 GiB
for the log-softmax autograd saves and a third for its gradient, on top of the
model's own 1.2 GiB of bf16 logits. Measured on the H200 under a 24 GiB cap, that
workspace made a plain ``loss.backward()`` loop of a 1.5B full fine-tune run out of
memory where the same model through ``TrainStreamTrainer`` (hidden-state chunked
loss, hf_loss.py) trained.

So ``wrap()`` sets the model's ``loss_function`` (transformers' own hook for it) to
the same loss computed row by row in fp32 registers (``_ce_kernels``: Triton on CUDA,
torch elsewhere, one fp32 copy of a block of rows at most): the forward keeps one fp32
log-sum-exp per token, the backward writes the gradient into one tensor in the
logits' dtype. The model's ``logits`` output is left alone (the gradient does not
reuse its storage), so code that reads it after ``backward()`` sees what it always did.
A loss the user set on the model is left alone, as are models whose loss is not the
causal LM's; the model's other keywords are ignored, as transformers' loss ignores them.
``wrap(lm_loss="model")`` keeps the model's loss.

It lives beside api.py rather than in integrations/ because wrap() installs it, and
integrations/ sits above api.py (docs/package-layout.md); transformers is imported only
when a model is looked at.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from . import _ce_kernels

# Rows per block on the torch path (its one fp32 copy of a block of logits). The
# Triton kernels read any number of rows without a copy.
_ROWS = 256


class _LogitsCrossEntropy(torch.autograd.Function):
    """Sum over rows of ``(lse(z) - z[target]) * scale`` for logits ``z`` [rows, vocab];
    rows with target -1 do not count (and have scale 0)."""

    @staticmethod
    def forward(ctx, logits, targets, scale):
        rows = logits.shape[0]
        m = torch.full((rows,), float("-inf"), dtype=torch.float32, device=logits.device)
        lsum = torch.zeros(rows, dtype=torch.float32, device=logits.device)
        zt = torch.zeros(rows, dtype=torch.float32, device=logits.device)
        step = rows if _ce_kernels.triton_usable(logits) else _ROWS
        for s in range(0, rows, step):
            e = min(rows, s + step)
            _ce_kernels.merge_stats(logits[s:e], m[s:e], lsum[s:e], zt[s:e], targets[s:e], 0)
        lse = m + torch.log(lsum)
        ctx.save_for_backward(logits, targets, scale, lse)
        # A row that does not count is never read, as F.cross_entropy never reads it
        # (inf * 0 would be NaN); its 0 * (1 / count) scale keeps 0/0 = NaN when no row
        # counts, as torch's mean over no tokens.
        per_row = torch.where(targets >= 0, lse - zt, torch.zeros_like(lse))
        return (per_row * scale).sum()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        logits, targets, scale, lse = ctx.saved_tensors
        grad = logits.clone()
        scale = scale * grad_out.to(torch.float32)
        rows = logits.shape[0]
        step = rows if _ce_kernels.triton_usable(grad) else _ROWS
        for s in range(0, rows, step):
            e = min(rows, s + step)
            _ce_kernels.write_grad(grad[s:e], lse[s:e], scale[s:e], targets[s:e], 0)
        return grad, None, None


def logits_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
                         num_items_in_batch: Any = None) -> torch.Tensor:
    """``F.cross_entropy(logits.float(), targets, ignore_index=...)`` (mean over the
    counted tokens, or their sum divided by ``num_items_in_batch``), for logits
    [tokens, vocab] in any float dtype, without an fp32 copy of them."""
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"logits must be [tokens, vocab] and targets [tokens]; got "
                         f"{tuple(logits.shape)} and {tuple(targets.shape)}")
    logits = logits.contiguous()
    targets = targets.to(logits.device)
    counted = targets != ignore_index
    vocab = logits.shape[1]
    bad = ((targets < 0) | (targets >= vocab)) & counted
    if logits.is_cuda:
        # Asserted on the device, as torch's own loss does: a host check would stall the
        # stream every step, and no check would train on a target matching no column.
        torch._assert_async(~bad.any(), f"targets must be in [0, {vocab}) or ignore_index "
                                         f"({ignore_index})")
    elif bool(bad.any()):
        raise ValueError(f"targets must be in [0, {vocab}) or ignore_index ({ignore_index})")
    if num_items_in_batch is None:
        denom = counted.sum().to(torch.float32)
    elif torch.is_tensor(num_items_in_batch):
        denom = num_items_in_batch.to(device=logits.device, dtype=torch.float32)
    else:
        denom = torch.tensor(float(num_items_in_batch), device=logits.device)
    # Uncounted rows still get 0 * (1 / denom): with nothing counted that is NaN, as
    # torch's mean over no tokens.
    scale = counted.to(torch.float32) * (1.0 / denom)
    t = torch.where(counted, targets, torch.full_like(targets, -1)).to(torch.int64)
    return _LogitsCrossEntropy.apply(logits, t, scale.to(torch.float32))


class CausalLMLoss:
    """A replacement for transformers' ``ForCausalLMLoss`` with its signature (a class,
    not a closure, so a wrapped model still pickles)."""
    trainstream = True

    def __init__(self, original: Callable):
        self.original = original

    def __call__(self, logits, labels, vocab_size=None, num_items_in_batch=None,
                 ignore_index=-100, shift_labels=None, **kwargs):
        # transformers' own ForCausalLMLoss ignores the model's other keywords (its
        # forward hands on everything it got: output_hidden_states and the like); any
        # other function gets them, with the call.
        # Tensor subclasses (a vocabulary-sharded DTensor, tracing's fake tensors) go to
        # the model's own loss: the row kernels read plain local memory.
        if ((kwargs and self.original is not _stock_loss()) or type(logits) is not torch.Tensor
                or not torch.is_floating_point(logits)):
            return self.original(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                                 ignore_index=ignore_index, shift_labels=shift_labels, **kwargs)
        if shift_labels is None:
            # Tokens < n predict n: the last position predicts nothing.
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        vocab = logits.shape[-1] if vocab_size is None else vocab_size
        return logits_cross_entropy(logits.reshape(-1, vocab), shift_labels.reshape(-1),
                                    ignore_index, num_items_in_batch)


def causal_lm_loss_function(original: Callable) -> Callable:
    return CausalLMLoss(original)


def _stock_loss() -> Optional[Callable]:
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:  # pragma: no cover - transformers is optional
        return None
    return ForCausalLMLoss


def _causal_lms(model: nn.Module) -> List[nn.Module]:
    """The transformers models inside ``model`` (PEFT's wrapper included) whose forward
    computes a causal-LM loss through ``self.loss_function``."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is optional
        return []
    out = []
    for m in model.modules():
        if not isinstance(m, PreTrainedModel) or m.get_output_embeddings() is None:
            continue
        if getattr(m, "loss_type", None) not in (None, "ForCausalLM"):
            continue
        if not type(m).__name__.endswith("ForCausalLM"):
            continue
        out.append(m)
    return out


def install(model: nn.Module) -> Optional[Callable[[], None]]:
    """Sets the loss of every causal LM in ``model``; returns what undoes it (None: there
    was none)."""
    done: List[nn.Module] = []
    for m in _causal_lms(model):
        # A loss the user set (model.loss_function = ...) is theirs: left alone.
        if "_loss_function" in m.__dict__:
            continue
        m.loss_function = CausalLMLoss(m.loss_function)
        done.append(m)
    if not done:
        return None

    def restore() -> None:
        for m in done:
            m.__dict__.pop("_loss_function", None)
    return restore
