"""Row kernels of the chunked cross-entropy (losses.py), in Triton for CUDA tensors.

A block of logits ``z`` (rows: tokens; columns: the vocabulary slice ``[s0, s0+cols)``,
in the matmul's dtype, contiguous) is read in fp32 registers and never upcast in memory:

- ``merge_stats``: folds the block into each row's running max ``m`` and sum of
  ``exp(z - m)`` ``l`` (fp32, one value per token), and takes ``z[target]`` when the
  row's target falls in the slice.
- ``write_grad``: overwrites the block with ``(exp(z - lse) - onehot(target)) * scale``,
  the loss's gradient with respect to these logits, in the block's own dtype.

Targets are -1 for tokens that do not count (and ``scale`` 0), so no column matches.
Each has a torch version (CPU, or CUDA without Triton) that does the same arithmetic
with one fp32 copy of the block; tests compare the two on the GPU.
"""
from __future__ import annotations

import os

import torch

try:  # Triton ships with torch's CUDA wheels; CPU-only installs lack it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

_BLOCK = 2048


def triton_usable(z: torch.Tensor) -> bool:
    """Whether the Triton kernels run for ``z`` (TRAINSTREAM_CE_KERNEL=torch turns them
    off, for comparison)."""
    return (triton is not None and z.is_cuda and z.is_contiguous()
            and os.environ.get("TRAINSTREAM_CE_KERNEL", "triton") != "torch")


if triton is not None:
    @triton.jit
    def _merge_stats_kernel(z_ptr, m_ptr, l_ptr, zt_ptr, t_ptr, s0, cols,
                            BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = z_ptr + row * cols
        bm = tl.full((), float("-inf"), tl.float32)
        bl = tl.zeros((), tl.float32)
        for off in range(0, cols, BLOCK):
            idx = off + tl.arange(0, BLOCK)
            x = tl.load(base + idx, mask=idx < cols, other=float("-inf")).to(tl.float32)
            nm = tl.maximum(bm, tl.max(x, 0))
            bl = bl * tl.exp(bm - nm) + tl.sum(tl.exp(x - nm), 0)
            bm = nm
        m = tl.load(m_ptr + row)
        l_run = tl.load(l_ptr + row)
        nm = tl.maximum(m, bm)
        # exp(-inf - -inf) would be NaN: a side that saw nothing adds nothing.
        a = tl.where(m == float("-inf"), 0.0, l_run * tl.exp(m - nm))
        b = tl.where(bm == float("-inf"), 0.0, bl * tl.exp(bm - nm))
        tl.store(m_ptr + row, nm)
        tl.store(l_ptr + row, a + b)
        local = tl.load(t_ptr + row) - s0
        if (local >= 0) & (local < cols):
            tl.store(zt_ptr + row, tl.load(base + local).to(tl.float32))

    @triton.jit
    def _write_grad_kernel(z_ptr, lse_ptr, scale_ptr, t_ptr, s0, cols, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = z_ptr + row * cols
        lse = tl.load(lse_ptr + row)
        scale = tl.load(scale_ptr + row)
        local = tl.load(t_ptr + row) - s0
        for off in range(0, cols, BLOCK):
            idx = off + tl.arange(0, BLOCK)
            mask = idx < cols
            x = tl.load(base + idx, mask=mask, other=0.0).to(tl.float32)
            g = tl.exp(x - lse)
            g = tl.where(idx == local, g - 1.0, g) * scale
            tl.store(base + idx, g.to(z_ptr.dtype.element_ty), mask=mask)


def merge_stats(z, m, lsum, zt, targets, s0):
    """Folds logits block ``z`` [rows, cols] (columns ``s0 ..``) into ``m``/``lsum`` and
    picks ``zt`` (all fp32 [rows], updated in place)."""
    rows, cols = z.shape
    if rows == 0:
        return
    if triton_usable(z):
        with torch.cuda.device(z.device):  # the current device may be another one
            _merge_stats_kernel[(rows,)](z, m, lsum, zt, targets, s0, cols, BLOCK=_BLOCK,
                                         num_warps=8)
        return
    # One fp32 copy of the block, reused in place (for an fp32 block .float() would be
    # the block itself, which write_grad still reads).
    zf = z.clone() if z.dtype == torch.float32 else z.float()
    local = targets - s0
    inside = (local >= 0) & (local < cols)
    got = zf.gather(1, local.clamp(0, cols - 1)[:, None]).squeeze(1)
    zt.copy_(torch.where(inside, got, zt))
    bm = zf.amax(1)
    nm = torch.maximum(m, bm)
    old = torch.where(m == float("-inf"), torch.zeros_like(lsum), lsum * torch.exp(m - nm))
    lsum.copy_(old + zf.sub_(nm[:, None]).exp_().sum(1))
    m.copy_(nm)


def write_grad(z, lse, scale, targets, s0):
    """Overwrites ``z`` with ``(softmax - onehot) * scale`` (``lse``, ``scale``: fp32
    [rows])."""
    rows, cols = z.shape
    if rows == 0:
        return
    if triton_usable(z):
        with torch.cuda.device(z.device):
            _write_grad_kernel[(rows,)](z, lse, scale, targets, s0, cols, BLOCK=_BLOCK,
                                        num_warps=8)
        return
    p = z.float().sub_(lse[:, None]).exp_()
    local = targets - s0
    inside = ((local >= 0) & (local < cols)).to(p.dtype)
    p.scatter_add_(1, local.clamp(0, cols - 1)[:, None], -inside[:, None])
    p.mul_(scale[:, None])
    z.copy_(p)
