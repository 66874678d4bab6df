"""The repeated block stack of a model: what pages, and whose frozen linears quantize.

One rule for every user (wrap()'s planner and pager, ``quantize_model``, ``load_model``):
the largest ``nn.ModuleList`` of at least two children that all have one type. The
type, not identical shapes: blocks of one class with different widths (a pruned model)
page and quantize as well as identical ones. At least two: one block is no stack to
choose from (paging it is paging the model). The first of equally long lists wins, in
``named_modules()`` order.
"""
from __future__ import annotations

from typing import List, Tuple

from torch import nn


def find_block_stack(model: nn.Module) -> Tuple[str, List[nn.Module]]:
    """``(qualified name, blocks)`` of the block stack; ``("", [])`` when there is none."""
    best_name, best = "", []
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) >= 2 and len(m) > len(best):
            if len({type(c) for c in m}) == 1:
                best_name, best = name, list(m)
    return best_name, best


def find_blocks(model: nn.Module) -> List[nn.Module]:
    """The repeated block stack: the largest ``nn.ModuleList`` of at least two children
    of one type (empty when there is none)."""
    return find_block_stack(model)[1]
