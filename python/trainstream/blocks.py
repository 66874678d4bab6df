"""The repeated block stack of a model: what pages, and whose frozen linears quantize.

One rule for every user (wrap()'s planner and pager, ``quantize_model``, ``load_model``):
the largest ``nn.ModuleList`` or ``nn.Sequential`` of at least two children that all
have one type (a model built as ``nn.Sequential(*blocks)`` has its stack there). The
type, not identical shapes: blocks of one class with different widths (a pruned model)
page and quantize as well as identical ones. At least two: one block is no stack to
choose from (paging it is paging the model). The first of equally long lists wins, in
``named_modules()`` order.

``chosen_blocks`` is the one reading of a per-block option (``param_offload``,
``recompute``, an ``ActivationOffloader``'s ``offload``): which block indices it names.
"""
from __future__ import annotations

import numbers
from typing import Any, List, Optional, Tuple

from torch import nn


def find_block_stack(model: nn.Module) -> Tuple[str, List[nn.Module]]:
    """``(qualified name, blocks)`` of the block stack; ``("", [])`` when there is none."""
    best_name, best = "", []
    for name, m in model.named_modules():
        if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) >= 2 and len(m) > len(best):
            if len({type(c) for c in m}) == 1:
                best_name, best = name, list(m)
    return best_name, best


def find_blocks(model: nn.Module) -> List[nn.Module]:
    """The repeated block stack: the largest ``nn.ModuleList`` or ``nn.Sequential`` of
    at least two children of one type (empty when there is none)."""
    return find_block_stack(model)[1]


def chosen_blocks(option: Any, n: int) -> Optional[List[int]]:
    """Block indices a per-block option names, of ``n`` blocks: None for "auto", every
    block for True, none for False, the first ``round(f * n)`` for a fraction ``f``, or
    the indices of a list / set (ValueError for one out of range)."""
    if isinstance(option, str) and option == "auto":
        return None
    if option is True:
        return list(range(n))
    if option is False:
        return []
    if isinstance(option, (list, tuple, set, frozenset)):
        bad = sorted(i for i in option if i >= n)
        if bad:
            raise ValueError(f"block indices {bad} out of range: the model has {n} blocks")
        return sorted(set(option))
    if isinstance(option, numbers.Real):
        return list(range(int(round(option * n))))
    raise ValueError(f"{option!r} names no blocks; accepted: 'auto', True, False, a fraction "
                     "in [0, 1] or block indices")
