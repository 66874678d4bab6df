"""Cross-entropy of a linear output layer without the full logits.

    loss = trainstream.causal_lm_loss(hidden, model.lm_head.weight, labels)

A causal LM's loss is usually ``F.cross_entropy(lm_head(hidden).float(), labels)``: the
logits of every token, ``tokens x vocab`` values (2,048 tokens of a 152k vocabulary are
1.2 GB in fp32), kept by autograd for backward. Here the tokens go through the output
layer ``chunk_size`` (256) at a time, and each chunk's logits become its loss and, in the
same pass, its gradients: two fused kernels (_ce_kernels.py) read the chunk's logits in
the matmul's dtype, take each row's log-sum-exp in fp32, and write ``softmax - onehot``
back over the logits, which two matmuls turn into the chunk's share of the gradients of
``hidden``, ``weight`` and ``bias``. Backward only scales those gradients by the
incoming one (a scalar loss's gradient is linear in it). Three matmuls, as the
full-logits loss does. Values and gradients equal ``F.cross_entropy`` on the upcast
logits (tests/python/test_losses.py).
"""
from __future__ import annotations

import numbers
from typing import Optional, Union

import torch
import torch.nn.functional as F

from . import _ce_kernels as _kernels

__all__ = ["chunked_cross_entropy", "causal_lm_loss"]


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the output layer's matmul runs in: autocast's where it is on (as
    ``lm_head(hidden)`` would run), else the inputs' own."""
    kind = hidden.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden is {hidden.dtype} and weight {weight.dtype}; accepted: one "
                         "dtype, or mixed dtypes under torch.autocast")
    return hidden.dtype


# Note [Chunks of tokens, 256 by default]
# Each chunk's rows of logits are whole, so one pass gives their loss and gradients
# (three matmuls in all, as the full-logits loss), but every chunk reads the whole
# weight twice and, when it trains, adds into the whole weight gradient: a fixed cost
# per chunk, so chunks below ~256 tokens make the loss bound by memory traffic. H200,
# 152k vocabulary (benchmarks/results/h200-2026-12-02-losses*.jsonl): 256 tokens ran in 0.92-1.07x
# F.cross_entropy's time, 128 in 1.17-1.77x. Splitting by vocabulary slices
# instead (a log-sum-exp pass, then a pass that recomputes each slice's logits and forms
# its gradients) never re-reads the weight, but cost a fourth matmul (1.2-1.6x) and
# summed hidden's gradient over the slices in bf16, 4-6x the full loss's error; it was
# dropped.
class _ChunkedCrossEntropy(torch.autograd.Function):
    """Sum over the counted tokens of ``-log_softmax(logits)[target]``, times ``scale``
    (1, or 1 / the denominator of a mean). With ``grads`` the gradients are formed in
    the same pass over each block of logits (a scalar loss's gradient is linear in the
    incoming gradient, so backward only scales them); the matmuls run in ``cdtype``
    with explicit casts (autocast is off inside); softmax statistics are fp32."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, scale, chunk_size, cdtype, grads):
        need_h, need_w, need_b = grads
        n, v = hidden.shape[0], weight.shape[0]
        dev = hidden.device
        counted = targets != -1
        row_scale = torch.where(counted, scale.expand(n), torch.zeros((), device=dev))
        m = torch.full((n,), float("-inf"), dtype=torch.float32, device=dev)
        l_sum = torch.zeros(n, dtype=torch.float32, device=dev)
        zt = torch.zeros(n, dtype=torch.float32, device=dev)
        grad_h = torch.empty_like(hidden) if need_h else None
        # The weight's gradient is summed over the chunks in its own dtype (for bf16,
        # one rounding per chunk, each product accumulated in fp32).
        grad_w = torch.zeros_like(weight) if need_w else None
        grad_b = torch.zeros(v, dtype=torch.float32, device=dev) if need_b else None
        with torch.autocast(dev.type, enabled=False):
            h = hidden.to(cdtype).contiguous()
            w = weight.to(cdtype)
            b = bias.to(cdtype) if bias is not None else None
            buf = torch.empty(min(n, chunk_size) * v, dtype=cdtype, device=dev)
            for r0 in range(0, n, chunk_size):
                r1 = min(n, r0 + chunk_size)
                z = _logits(h[r0:r1], w, b, buf)
                _kernels.merge_stats(z, m[r0:r1], l_sum[r0:r1], zt[r0:r1], targets[r0:r1], 0)
                if not any(grads):
                    continue
                lse = m[r0:r1] + torch.log(l_sum[r0:r1])
                _kernels.write_grad(z, lse, row_scale[r0:r1], targets[r0:r1], 0)
                if need_h:
                    _mm_into(grad_h[r0:r1], z, w, accumulate=False)
                if need_w:
                    _mm_into(grad_w, z.t(), h[r0:r1], accumulate=True)
                if need_b:
                    grad_b += z.sum(0, dtype=torch.float32)
            del buf
        lse = m + torch.log(l_sum)
        per_token = torch.where(counted, lse - zt, torch.zeros_like(zt))
        # Held on ctx, not saved: backward hands them to autograd and drops its own
        # reference, so a leaf's .grad takes the buffer instead of a copy.
        ctx.grads = (grad_h, grad_w, grad_b)
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return per_token.sum() * scale

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        if ctx.grads is None:
            raise RuntimeError(
                "chunked_cross_entropy: a second backward through the same loss; its "
                "gradients are formed in forward and handed over by the first backward. "
                "Accepted: one backward per loss (compute the loss again for another)")
        grad_h, grad_w, grad_b = ctx.grads
        ctx.grads = None
        if not bool(grad_out == 1):
            for g in (grad_h, grad_w):
                if g is not None:
                    g.mul_(grad_out.to(g.dtype))
            if grad_b is not None:
                grad_b.mul_(grad_out)
        if grad_b is not None:
            grad_b = grad_b.to(ctx.bias_dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None


def _logits(h, w, b, buf):
    """``F.linear(h, w, b)`` written into the front of ``buf`` (contiguous)."""
    out = buf[:h.shape[0] * w.shape[0]].view(h.shape[0], w.shape[0])
    if b is None:
        return torch.mm(h, w.t(), out=out)
    return torch.addmm(b, h, w.t(), out=out)


def _mm_into(out, a, b, accumulate):
    """``out (+)= a @ b``; in ``out``'s dtype when ``a``'s differs (autocast with fp32
    parameters)."""
    if out.dtype == a.dtype:
        if accumulate:
            out.addmm_(a, b)
        else:
            torch.mm(a, b, out=out)
    elif accumulate:
        out.add_(a.to(out.dtype) @ b.to(out.dtype))
    else:
        out.copy_(a.to(out.dtype) @ b.to(out.dtype))


# Tokens per chunk by default: Note [Chunks of tokens, 256 by default].
DEFAULT_CHUNK_SIZE = 256


def _check(hidden, weight, targets, bias, chunk_size, reduction, num_items):
    if not (torch.is_tensor(hidden) and hidden.dim() >= 1 and hidden.is_floating_point()):
        raise ValueError(f"hidden must be a floating tensor [..., D]; got "
                         f"{type(hidden).__name__ if not torch.is_tensor(hidden) else tuple(hidden.shape)}")
    if not (torch.is_tensor(weight) and weight.dim() == 2 and weight.shape[1] == hidden.shape[-1]):
        raise ValueError(f"weight must be [V, D] with D = hidden's last dimension "
                         f"({hidden.shape[-1]}); got "
                         f"{tuple(weight.shape) if torch.is_tensor(weight) else type(weight).__name__}")
    if bias is not None and not (torch.is_tensor(bias) and tuple(bias.shape) == (weight.shape[0],)):
        raise ValueError(f"bias must be None or [V] = [{weight.shape[0]}]; got "
                         f"{tuple(bias.shape) if torch.is_tensor(bias) else type(bias).__name__}")
    if not (torch.is_tensor(targets) and not targets.is_floating_point()
            and not targets.is_complex() and targets.dtype != torch.bool):
        raise ValueError("targets must be an integer tensor of class indices")
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"targets has shape {tuple(targets.shape)}; accepted: hidden's leading "
                         f"shape {tuple(hidden.shape[:-1])}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                   or chunk_size < 1):
        raise ValueError(f"chunk_size={chunk_size!r}; accepted: None (256) or an integer >= 1 "
                         "(tokens per chunk)")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction={reduction!r}; accepted: 'mean' or 'sum'")
    if num_items is not None:
        if reduction != "mean":
            raise ValueError("num_items replaces the count of a mean; accepted only with "
                             "reduction='mean'")
        ok = (torch.is_tensor(num_items) and num_items.numel() == 1) or \
            (isinstance(num_items, numbers.Real) and not isinstance(num_items, bool))
        if not ok:
            raise ValueError(f"num_items={num_items!r}; accepted: None, a number or a "
                             "one-element tensor")


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                          bias: Optional[torch.Tensor] = None, *, chunk_size: Optional[int] = None,
                          ignore_index: int = -100, reduction: str = "mean",
                          num_items: Optional[Union[int, float, torch.Tensor]] = None
                          ) -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias).float(), targets)`` without the logits.

    Args:
        hidden: ``[..., D]``, the output layer's input (after the final norm).
        weight: ``[V, D]``, the output layer's weight (trainable or frozen).
        targets: class indices, ``hidden``'s leading shape; ``ignore_index`` entries
            do not count.
        bias: ``[V]`` or None.
        chunk_size: tokens whose logits exist at once (``chunk_size x V`` values in the
            matmul's dtype); None: 256 (TrainStream 0.5 used 1024: docs/losses.md).
        reduction: "mean" (over the counted tokens: NaN when none counts, as
            ``F.cross_entropy``) or "sum".
        num_items: with "mean", divide the sum by this instead of the counted tokens
            (Hugging Face's ``num_items_in_batch`` under gradient accumulation).
    """
    _check(hidden, weight, targets, bias, chunk_size, reduction, num_items)
    v = weight.shape[0]
    h2 = hidden.reshape(-1, hidden.shape[-1])
    t1 = targets.reshape(-1).to(device=hidden.device, dtype=torch.long)
    bad = (t1 != ignore_index) & ((t1 < 0) | (t1 >= v))
    if t1.numel() and bool(bad.any()):
        first = int(t1[bad][0])
        raise ValueError(f"targets holds {first}, outside [0, {v}) and not ignore_index "
                         f"({ignore_index})")
    if reduction == "sum":
        scale = torch.ones((), dtype=torch.float32, device=hidden.device)
    elif num_items is not None:
        scale = 1.0 / torch.as_tensor(num_items, dtype=torch.float32, device=hidden.device)
    else:
        scale = 1.0 / (t1 != ignore_index).sum().to(torch.float32)
    cdtype = _compute_dtype(hidden, weight)
    on = torch.is_grad_enabled()
    grads = (on and hidden.requires_grad, on and weight.requires_grad,
             on and bias is not None and bias.requires_grad)
    # -1 marks a token that does not count (no column matches it in the kernels).
    t1 = torch.where(t1 != ignore_index, t1, torch.full_like(t1, -1))
    return _ChunkedCrossEntropy.apply(h2, weight, bias, t1, scale.reshape(()),
                                      chunk_size or DEFAULT_CHUNK_SIZE, cdtype, grads)


def causal_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: Optional[torch.Tensor],
                   bias: Optional[torch.Tensor] = None, *,
                   shift_labels: Optional[torch.Tensor] = None, **kwargs) -> torch.Tensor:
    """The next-token loss as Hugging Face's causal LMs compute it: position ``i``
    predicts ``labels[..., i + 1]``, the last position predicts nothing. ``hidden``
    ``[..., T, D]``, ``labels`` ``[..., T]``; or ``shift_labels``, already shifted (as
    ``ForCausalLMLoss`` takes them), with ``labels`` None. ``kwargs`` as
    ``chunked_cross_entropy``."""
    if shift_labels is not None:
        if labels is not None:
            raise ValueError("give labels or shift_labels, not both")
        return chunked_cross_entropy(hidden, weight, shift_labels, bias, **kwargs)
    if not (torch.is_tensor(labels) and labels.dim() >= 1):
        raise ValueError("labels must be a tensor [..., T] of token ids")
    if torch.is_tensor(hidden) and tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"labels must have hidden's leading shape {tuple(hidden.shape[:-1])}; "
                         f"got {tuple(labels.shape)}")
    ignore_index = kwargs.get("ignore_index", -100)
    shifted = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return chunked_cross_entropy(hidden, weight, shifted, bias, **kwargs)
