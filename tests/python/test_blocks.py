"""The one block-stack rule (trainstream/blocks.py), which wrap()'s planner and pager,
quantize_model and load_model share: the largest nn.ModuleList of at least two
children of one type."""
import torch
from torch import nn

import trainstream
from quant_helpers import Block, TinyTransformer
from trainstream.blocks import find_block_stack
from trainstream.frozen.quantization import QuantLinear, quantize_model


def test_the_largest_list_of_one_type_is_the_stack():
    model = TinyTransformer(layers=3)
    model.heads = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])       # shorter
    model.mixed = nn.ModuleList([Block(), nn.Linear(4, 4), Block(), Block()])  # two types
    assert find_block_stack(model) == ("blocks", list(model.blocks))
    assert trainstream.find_blocks(model) == list(model.blocks)


def test_one_child_is_no_stack():
    model = TinyTransformer(layers=1)
    assert find_block_stack(model) == ("", [])
    assert trainstream.find_blocks(model) == []


def test_blocks_of_one_type_with_different_widths_are_a_stack_and_quantize():
    """Before, quantize_model wanted structurally identical blocks (same parameter
    shapes) and refused a stack whose blocks differ in width (a pruned model)."""
    torch.manual_seed(0)
    model = TinyTransformer(layers=3)
    model.blocks[1] = Block(hidden=96)
    model.requires_grad_(False)
    assert trainstream.find_blocks(model) == list(model.blocks)
    result = quantize_model(model, quantize="int8")
    assert result["tensors"] == 12
    assert all(isinstance(m, QuantLinear) for b in model.blocks
               for m in (b.qkv, b.proj, b.up, b.down))
    assert model.blocks[1].up.out_features == 96


def test_skip_trained_leaves_adapters_and_quantizes_the_rest():
    """wrap()'s plan quantizes through quantize_model with skip_trained=True: a trained
    Linear inside a block (a LoRA adapter) stays as it is."""
    model = TinyTransformer(layers=2)
    model.requires_grad_(False)
    for b in model.blocks:
        b.proj.requires_grad_(True)
    result = quantize_model(model, quantize="nf4", skip_trained=True)
    assert result["tensors"] == 6
    assert all(type(b.proj) is nn.Linear and b.proj.weight.requires_grad for b in model.blocks)
    assert all(isinstance(b.up, QuantLinear) for b in model.blocks)
