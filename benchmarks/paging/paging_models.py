"""The models bench_paging.py trains: Qwen2.5 shapes with random weights, built layer by
layer (on the GPU when there is one), never the whole model in fp32 or on disk.

A LoRA case's frozen base (every frozen tensor of ``min_bytes`` or more: the block
stack's linear weights, NF4 or bf16, the embedding and the output layer) goes into one
region of the daemon's shared memory (``DaemonBase``), registered with CUDA: wrap()'s
pager then pages it from there as it does a base that ``load_model`` loaded, and the
process holds no copy of its own (docs/design.md, "Base cache"). The region is a
session region of the benchmark's own daemon session (label ``frozen base``), not a
base-cache segment: a random base has no checkpoint to key a cached base by, and a
bf16 checkpoint of a 72B shape (145 GB) does not fit the GPU host's disk. The
difference for paging: a base segment is mapped read-only, and H2D from a read-only
registration ran at 48 GB/s on the GPU host against 55 from this read-write one.
"""
from __future__ import annotations

import math
from typing import Iterable, Optional, Tuple

SHAPES = {  # Qwen2.5 published shapes
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False),
    "14b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
                num_attention_heads=40, num_key_value_heads=8, tie_word_embeddings=False),
    "32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                num_attention_heads=40, num_key_value_heads=8, tie_word_embeddings=False),
    "72b": dict(hidden_size=8192, intermediate_size=29568, num_hidden_layers=80,
                num_attention_heads=64, num_key_value_heads=8, tie_word_embeddings=False),
}
TINY = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, tie_word_embeddings=False)
FROZEN_BASE_LABEL = "frozen base"
_ALIGN = 4096
NF4_BLOCK = 64


def qwen_config(size: str, tiny: bool, vocab: int, layers: Optional[int] = None):
    """Qwen2Config of ``size`` (a SHAPES key; TINY's widths with ``tiny``), with
    ``layers`` blocks instead of the shape's own when given."""
    from transformers import Qwen2Config
    shape = dict(TINY if tiny else SHAPES[size])
    if layers is not None:
        shape["num_hidden_layers"] = layers
    cfg = Qwen2Config(vocab_size=vocab, max_position_embeddings=32768, rope_theta=1e6,
                      rms_norm_eps=1e-6, **shape)
    cfg._attn_implementation = "sdpa"
    return cfg


def shape_params(size: str, layers: int, vocab: int = 152064) -> Tuple[int, int]:
    """(parameters of one block, parameters outside the blocks) of a SHAPES entry:
    the arithmetic behind the layer counts docs/paging.md estimates."""
    s = SHAPES[size]
    h, i = s["hidden_size"], s["intermediate_size"]
    kv = h // s["num_attention_heads"] * s["num_key_value_heads"]
    block = (h * h + h) + 2 * (h * kv + kv) + h * h + 3 * h * i + 2 * h
    return block, 2 * vocab * h + h


def lora(linear, r: int, alpha: float = 32.0):
    """``linear`` (an nn.Linear or a QuantLinear, frozen) with a LoRA adapter:
    y = base(x) + (x A^T) B^T * (alpha / r); A and B (fp32) are trained."""
    import torch
    from torch import nn

    class LoRA(nn.Module):
        def __init__(self, base):
            super().__init__()
            self.base = base
            inp, out = base.in_features, base.out_features
            dev = next(base.buffers(), None)
            dev = dev.device if dev is not None else base.weight.device
            self.lora_A = nn.Parameter(torch.empty(r, inp, device=dev))
            self.lora_B = nn.Parameter(torch.zeros(out, r, device=dev))
            nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
            self.scale = alpha / r

        def forward(self, x):
            y = self.base(x)
            a = x.to(self.lora_A.dtype) if not torch.is_autocast_enabled(x.device.type) else x
            return y + (a @ self.lora_A.t() @ self.lora_B.t()).to(y.dtype) * self.scale
    return LoRA(linear)


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def frozen_extents(model, mode: str) -> Iterable[int]:
    """Bytes of each frozen tensor a LoRA build of the (meta) ``model`` makes: every
    parameter in bf16, a block-stack linear weight as NF4 codes and fp32 block scales
    (mode 'lora-nf4')."""
    from torch import nn
    quantized = set()
    if mode == "lora-nf4":
        for layer in model.model.layers:
            quantized.update(id(m.weight) for m in layer.modules() if isinstance(m, nn.Linear))
    for p in model.parameters():
        if id(p) in quantized:
            blocks = (p.numel() + NF4_BLOCK - 1) // NF4_BLOCK
            yield from (blocks * NF4_BLOCK // 2, blocks * 4, 4)
        else:
            yield p.numel() * 2


class DaemonBase:
    """One region of the daemon's shared memory holding a model's frozen tensors, in a
    session of its own (module docstring). Must outlive the model built over it."""

    def __init__(self, socket: Optional[str], nbytes: int, min_bytes: int):
        import torch
        from trainstream._native import C
        from trainstream._native import daemon as _daemon
        from trainstream._native.pinning import register_fresh
        self.session = _daemon.connect(socket, spawn=False).attach(job="bench-frozen-base")
        self.region = self.session.allocate_region(max(nbytes, _ALIGN), FROZEN_BASE_LABEL)
        self.capacity = self.region.size
        self.bytes = C().tensor_from_address(self.region.address, [self.capacity], "uint8")
        self.used = 0
        self.placed = 0  # bytes of tensors placed
        self.min_bytes = min_bytes
        # Registered read-write, the whole segment as the activation pages' regions are
        # (wrap()'s pager pages a registered frozen tensor where it is); without CUDA the
        # pager copies it (tiny runs on a CPU).
        self.registered, self.why = (False, "no CUDA") if not torch.cuda.is_available() \
            else register_fresh(self.region.base_address, self.region.segment_size)

    def place(self, t):
        """A view of the region holding ``t``'s values (its dtype and shape)."""
        n = t.numel() * t.element_size()
        at = _align(self.used)
        if at + n > self.capacity:
            raise RuntimeError(f"frozen base region full: {at + n} > {self.capacity} bytes")
        view = self.bytes[at:at + n].view(t.dtype).view(t.shape)
        view.copy_(t)
        self.used, self.placed = at + n, self.placed + n
        return view

    def take(self, module) -> None:
        """Moves ``module``'s frozen parameters and buffers of ``min_bytes`` or more into
        the region (the module's tensors then view it)."""
        for m in module.modules():
            for p in m._parameters.values():
                if p is not None and not p.requires_grad and self._big(p):
                    p.data = self.place(p.data)
            for name, b in list(m._buffers.items()):
                if b is not None and self._big(b):
                    m._buffers[name] = self.place(b)

    def _big(self, t) -> bool:
        return t.numel() * t.element_size() >= self.min_bytes


def build(size: str, *, tiny: bool, dtype, mode: str, init_device: str, vocab: int,
          lora_r: int = 16, layers: Optional[int] = None, socket: Optional[str] = None,
          min_bytes: int = 1 << 20):
    """(model, DaemonBase or None). mode: 'full' (every weight trained, the model in host
    memory in ``dtype``), 'lora-bf16' or 'lora-nf4' (a frozen base in a DaemonBase on
    ``socket``'s daemon, LoRA r=``lora_r`` on every block linear)."""
    import torch
    from torch import nn
    from transformers import Qwen2ForCausalLM
    from trainstream.frozen.quantization import QuantLinear
    cfg = qwen_config(size, tiny, vocab, layers)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(cfg)
    model.model.rotary_emb = type(model.model.rotary_emb)(config=cfg)  # real buffers
    base = None
    if mode != "full":
        base = DaemonBase(socket, sum(_align(n) for n in frozen_extents(model, mode)),
                          min_bytes)
    g = torch.Generator(device=init_device).manual_seed(0)

    def materialize(module):
        module.to_empty(device=init_device, recurse=True)
        with torch.no_grad():
            for name, p in module.named_parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, 0.02, generator=g)
                elif "norm" in name or name.endswith("weight"):
                    p.fill_(1.0)
                else:
                    p.zero_()
        module.to(dtype)

    def settle(module):  # frozen tensors into the daemon's region, the rest to the host
        if base is not None:
            base.take(module)
        module.to("cpu")
    for m in (model.model.embed_tokens, model.model.norm, model.lm_head):
        materialize(m)
        if mode != "full":
            m.requires_grad_(False)
        settle(m)
    for layer in model.model.layers:
        materialize(layer)
        if mode != "full":
            layer.requires_grad_(False)
            for parent in list(layer.modules()):
                for name, child in list(parent.named_children()):
                    if isinstance(child, nn.Linear):
                        frozen = QuantLinear.from_linear(child, "nf4", NF4_BLOCK) \
                            if mode == "lora-nf4" else child
                        setattr(parent, name, lora(frozen, lora_r))
        settle(layer)
    if init_device == "cuda":
        torch.cuda.empty_cache()
    return model, base


def grow(model, init_device: str, dtype) -> None:
    """Appends one more block to a 'full' model that ``build`` made (random weights,
    built on ``init_device`` and moved to host memory, as build's are)."""
    import torch
    cfg = model.config
    i = len(model.model.layers)
    cfg.num_hidden_layers = i + 1
    if getattr(cfg, "layer_types", None) is not None:  # one attention type per layer
        cfg.layer_types = list(cfg.layer_types) + [cfg.layer_types[-1]]
    with torch.device(init_device):
        layer = type(model.model.layers[0])(cfg, layer_idx=i)
    g = torch.Generator(device=init_device).manual_seed(1000 + i)
    with torch.no_grad():
        for p in layer.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02, generator=g)
    model.model.layers.append(layer.to(dtype).to("cpu"))


def shrink(model) -> None:
    """Drops the last block of a model that ``build`` made (its memory goes with it)."""
    cfg = model.config
    del model.model.layers[-1]
    cfg.num_hidden_layers = len(model.model.layers)
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = list(cfg.layer_types)[:cfg.num_hidden_layers]
