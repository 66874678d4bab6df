"""Cross-entropy over a linear head without building the full logits.

A causal LM's last step, ``logits = hidden @ lm_head.T`` followed by cross-entropy,
holds a ``[tokens, vocab]`` tensor (several of them, once upcast to fp32 and with
their gradient): at 8192 tokens and Qwen2.5's 151936-word vocabulary that is 5 GB per
fp32 copy, often the largest tensor of the whole step. ``chunked_cross_entropy`` runs
the head and the loss a chunk of tokens at a time. The forward keeps one fp32
log-sum-exp per token; the backward recomputes each chunk's logits and turns them
into that chunk's share of the hidden, weight and bias gradients, so the extra memory
is about one chunk's logits plus the gradients themselves.

Numerics follow what Hugging Face does on the full logits: the product is computed in
the inputs' dtype, upcast to fp32 for the softmax, and the logits' gradient goes back
to the inputs' dtype before the two gradient products. The weight's gradient is
summed over chunks in fp32 and cast once at the end.

``causal_lm_loss`` is Hugging Face's ``ForCausalLMLoss`` (labels shifted left by one,
the last position ignored) on top of it. Neither loads TrainStream's compiled modules.
"""
from __future__ import annotations

import numbers

import torch

__all__ = ["causal_lm_loss", "chunked_cross_entropy"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_REDUCTIONS = ("mean", "sum")


def _logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """One chunk's logits in fp32: the product in the inputs' dtype, then upcast."""
    out = torch.addmm(bias, hidden, weight.t()) if bias is not None else hidden @ weight.t()
    return out.float() if out.dtype != torch.float32 else out


def _add_weight_grad(acc: torch.Tensor, grad_logits: torch.Tensor, hidden: torch.Tensor) -> None:
    """acc (fp32) += grad_logits.T @ hidden, without a [V, D] temporary where torch allows."""
    if grad_logits.dtype == torch.float32:
        acc.addmm_(grad_logits.t(), hidden)
    elif acc.is_cuda:
        # cuBLAS writes the half-precision product straight into the fp32 sum.
        torch.addmm(acc, grad_logits.t(), hidden, out_dtype=torch.float32, out=acc)
    else:
        # The CPU has no mixed-dtype addmm; round each chunk's product once.
        acc.add_(grad_logits.t() @ hidden)


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Autograd for the chunked loss; inputs are already flat and checked."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_size, ignore_index, divisor):
        n = hidden.shape[0]
        valid = targets != ignore_index
        safe_targets = torch.where(valid, targets, 0)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        target_logit = torch.empty(n, dtype=torch.float32, device=hidden.device)
        for start in range(0, n, chunk_size):
            end = min(start + chunk_size, n)
            logits = _logits(hidden[start:end], weight, bias)
            torch.logsumexp(logits, dim=-1, out=lse[start:end])
            target_logit[start:end] = logits.gather(1, safe_targets[start:end, None]).squeeze(1)
            del logits
        per_token = torch.where(valid, lse - target_logit, 0.0)
        loss = per_token.sum() / divisor
        ctx.save_for_backward(hidden, weight, bias, safe_targets, valid, lse, divisor)
        ctx.chunk_size = chunk_size
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, bias, safe_targets, valid, lse, divisor = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        n, chunk_size = hidden.shape[0], ctx.chunk_size
        # Ignored rows get exactly zero (as F.cross_entropy's), even where the scale is
        # inf or nan (mean over no counted position, num_items=0).
        row_scale = torch.where(valid, grad_loss.float() / divisor, 0.0)
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = (torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
                       if need_weight else None)
        grad_bias = (torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
                     if need_bias else None)
        for start in range(0, n, chunk_size):
            end = min(start + chunk_size, n)
            h = hidden[start:end]
            # softmax - one_hot(target), scaled per row, all in place on the fp32 chunk.
            grad = _logits(h, weight, bias)
            grad.sub_(lse[start:end, None]).exp_()
            rows = torch.arange(end - start, device=grad.device)
            grad[rows, safe_targets[start:end]] -= 1.0
            grad.mul_(row_scale[start:end, None])
            if need_bias:
                grad_bias.add_(grad.sum(0))
            grad = grad.to(hidden.dtype)
            if need_hidden:
                torch.mm(grad, weight, out=grad_hidden[start:end])
            if need_weight:
                _add_weight_grad(grad_weight, grad, h)
            del grad
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def _check(hidden, weight, targets, bias, chunk_size, ignore_index, reduction, num_items):
    if not isinstance(hidden, torch.Tensor) or not isinstance(weight, torch.Tensor) \
            or not isinstance(targets, torch.Tensor):
        raise TypeError("chunked_cross_entropy: hidden, weight and targets must be tensors, got "
                        f"{type(hidden).__name__}, {type(weight).__name__}, {type(targets).__name__}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive integer (tokens per chunk), got {chunk_size!r}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral):
        raise ValueError(f"ignore_index must be an integer, got {ignore_index!r}")
    if hidden.dim() < 1:
        raise ValueError("hidden must have shape [..., D], got a 0-d tensor")
    if weight.dim() != 2:
        raise ValueError(f"weight must have shape [V, D], got {tuple(weight.shape)}")
    if hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden's last dimension ({hidden.shape[-1]}) must equal weight's second "
                         f"(D); got hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}")
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"targets must have hidden's leading shape {tuple(hidden.shape[:-1])}, "
                         f"got {tuple(targets.shape)}")
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise ValueError(f"targets must hold class indices (an integer dtype), got {targets.dtype}")
    if hidden.dtype not in _DTYPES or weight.dtype != hidden.dtype:
        raise ValueError("hidden and weight must share one dtype among float32, bfloat16, float16; "
                         f"got hidden {hidden.dtype}, weight {weight.dtype}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (weight.shape[0],):
            shape = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
            raise ValueError(f"bias must be None or a tensor of shape [V] = ({weight.shape[0]},), "
                             f"got {shape}")
        if bias.dtype != hidden.dtype:
            raise ValueError(f"bias must have hidden's dtype {hidden.dtype}, got {bias.dtype}")
    devices = {t.device for t in (hidden, weight, targets, bias) if t is not None}
    if len(devices) > 1:
        raise ValueError("hidden, weight, targets and bias must be on one device, got "
                         + ", ".join(sorted(str(d) for d in devices)))
    if num_items is not None:
        if isinstance(num_items, torch.Tensor):
            if num_items.numel() != 1:
                raise ValueError("num_items must be a number or a one-element tensor, got a tensor "
                                 f"of shape {tuple(num_items.shape)}")
        elif isinstance(num_items, bool) or not isinstance(num_items, numbers.Real):
            raise ValueError(f"num_items must be None, a number or a 0-d tensor, got {num_items!r}")


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                          bias: torch.Tensor | None = None, *, chunk_size: int = 1024,
                          ignore_index: int = -100, reduction: str = "mean",
                          num_items: int | torch.Tensor | None = None) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T (+ bias)`` against ``targets``, chunk by chunk.

    Args:
        hidden: ``[..., D]``, the activations after the final norm (bf16, fp16 or fp32).
        weight: ``[V, D]``, the output head, in hidden's dtype. A weight that does not
            require grad (a frozen head) gets no gradient work.
        targets: class indices of shape ``hidden.shape[:-1]``; ``ignore_index`` marks
            positions that do not count.
        bias: ``[V]`` or None.
        chunk_size: tokens per chunk; the extra memory is about ``chunk_size x V`` fp32.
        reduction: ``"mean"`` (over the counted positions) or ``"sum"``.
        num_items: divide the sum by this instead (an int or a 0-d tensor), as Hugging
            Face does under gradient accumulation; overrides ``reduction``.

    Returns:
        A 0-d fp32 tensor. As ``F.cross_entropy``: ``"mean"`` with no counted position
        (every target ignored, or no tokens) is nan, and every gradient is then zero.

    Raises:
        ValueError: a shape, dtype, device or option is wrong, or a counted target lies
            outside ``[0, V)`` (checked on the host: one synchronisation per call).
    """
    _check(hidden, weight, targets, bias, chunk_size, ignore_index, reduction, num_items)
    vocab = weight.shape[0]
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_targets = targets.reshape(-1).long()
    valid = flat_targets != ignore_index
    bad = valid & ((flat_targets < 0) | (flat_targets >= vocab))
    if bool(bad.any()):
        first = int(flat_targets[bad][0])
        raise ValueError(f"targets must lie in [0, {vocab}) or equal ignore_index={ignore_index}; "
                         f"got {first}")
    device = flat_hidden.device
    if num_items is not None:
        divisor = torch.as_tensor(num_items, device=device).reshape(()).float()
    elif reduction == "mean":
        divisor = valid.sum().float()
    else:
        divisor = torch.ones((), device=device)
    return _ChunkedCrossEntropy.apply(flat_hidden, weight, bias, flat_targets, int(chunk_size),
                                      int(ignore_index), divisor)


def causal_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                   bias: torch.Tensor | None = None, *, shift_labels: torch.Tensor | None = None,
                   **kwargs) -> torch.Tensor:
    """The next-token loss as Hugging Face's ``ForCausalLMLoss`` computes it, in chunks.

    Position ``t`` of ``hidden`` ``[..., T, D]`` predicts ``labels[..., t + 1]``; the last
    position predicts nothing (ignored). ``shift_labels``, when given, are the already
    shifted targets (HF's argument of that name) and ``labels`` is then not read.
    ``kwargs`` are ``chunked_cross_entropy``'s (``chunk_size``, ``ignore_index``,
    ``reduction``, ``num_items``). HF divides by ``num_items_in_batch`` when one is
    given and otherwise takes the mean; pass it as ``num_items``.
    """
    ignore_index = kwargs.get("ignore_index", -100)
    if shift_labels is None:
        if not isinstance(labels, torch.Tensor) or labels.dim() < 1:
            raise ValueError("labels must be a tensor of shape [..., T] (hidden's leading shape)")
        if tuple(labels.shape) != tuple(hidden.shape[:-1]):
            raise ValueError(f"labels must have hidden's leading shape {tuple(hidden.shape[:-1])}, "
                             f"got {tuple(labels.shape)}")
        shift_labels = torch.nn.functional.pad(labels[..., 1:], (0, 1), value=ignore_index)
    return chunked_cross_entropy(hidden, weight, shift_labels.to(hidden.device), bias, **kwargs)
