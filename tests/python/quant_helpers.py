"""Shared pieces of the quantization tests: on-grid tensors, adversarial tensors, the
documented error table (docs/quantization.md) and a small transformer-like model."""
import math
import re
from pathlib import Path

import torch
from torch import nn

FORMATS = ("int8", "nf4", "fp8", "nvfp4")
DOCS = Path(__file__).resolve().parents[2] / "docs" / "quantization.md"

NF4_TABLE = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
             -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
             0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
             0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
             0.7229568362236023, 1.0]
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def documented_errors():
    """{format: mean relative error} from the table between the error-table markers."""
    text = DOCS.read_text()
    body = text.split("<!-- error-table -->")[1]
    table = {}
    for fmt, pct in re.findall(r"^\|\s*(int8|nf4|fp8|nvfp4)\s*\|\s*([0-9.]+)\s*%", body, re.M):
        table[fmt] = float(pct) / 100.0
    return table


def mean_relative_error(x, y):
    """mean |x - y| / mean |x|: the error relative to the typical weight magnitude."""
    x, y = x.double(), y.double()
    return float((x - y).abs().mean() / x.abs().mean())


def gaussian(n=1 << 20, seed=0, std=0.02):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * std


def on_grid(fmt, blocks=40, seed=0):
    """Values that each format represents exactly, with power-of-two (or e4m3) scales and
    one element per block at the top of the range, so quantizing them changes nothing."""
    g = torch.Generator().manual_seed(seed)
    if fmt == "int8":
        q = torch.randint(-127, 128, (blocks, 64), generator=g).float()
        q[:, 0] = 127.0
        scale = torch.pow(2.0, torch.randint(-10, 10, (blocks, 1), generator=g).float())
        return (q * scale).flatten()
    if fmt == "nf4":
        codes = torch.randint(0, 16, (blocks, 64), generator=g)
        codes[:, 0] = 15
        scale = torch.pow(2.0, torch.randint(-10, 10, (blocks, 1), generator=g).float())
        return (torch.tensor(NF4_TABLE)[codes] * scale).flatten()
    if fmt == "fp8":
        codes = torch.randint(0, 256, (blocks, 32), generator=g, dtype=torch.int32)
        codes = torch.where((codes & 0x7F) == 0x7F, torch.zeros_like(codes), codes)  # no NaN
        codes[:, 0] = 0x7E  # 448
        vals = codes.to(torch.uint8).view(torch.float8_e4m3fn).float()
        scale = torch.pow(2.0, torch.randint(-10, 10, (blocks, 1), generator=g).float())
        return (vals * scale).flatten()
    # nvfp4: e2m1 codes * e4m3 block scale * tensor scale 2^-4, one block scale at 448.
    codes = torch.randint(0, 16, (blocks, 16), generator=g)
    codes[:, 0] = 7  # 6.0
    sb = torch.randint(0x30, 0x7F, (blocks, 1), generator=g, dtype=torch.int32)
    sb[0, 0] = 0x7E
    block_scale = sb.to(torch.uint8).view(torch.float8_e4m3fn).float()
    return (torch.tensor(E2M1)[codes] * (block_scale * 0.0625)).flatten()


def adversarial():
    """(name, tensor) pairs: what breaks careless quantizers."""
    g = torch.Generator().manual_seed(3)
    base = torch.randn(100_003, generator=g) * 0.02
    out = [("gaussian", base)]
    z = base.clone()
    z[64:512] = 0.0
    out.append(("zero blocks", z))
    out.append(("all zero", torch.zeros(999)))
    o = base.clone()
    o[777] = 3.0e4
    out.append(("one huge outlier", o))
    bits = torch.randint(1, 0x007FFFFF, (4099,), generator=g, dtype=torch.int32)
    sign = torch.randint(0, 2, (4099,), generator=g, dtype=torch.int32) << 31
    sub = (bits | sign).view(torch.float32)
    out.append(("subnormals", sub))
    m = base.clone()
    m[:4099 * 10:10] = sub
    out.append(("subnormals among normals", m))
    out.append(("odd tiny", torch.tensor([0.5, -0.25, 3.0])))
    out.append(("range", torch.tensor([1e30, -1e-30, 65504.0, -3.0e38, 1.0, 2.0 ** -140])))
    return out


class Block(nn.Module):
    def __init__(self, d=64, hidden=160):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d, bias=False)
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)

    def forward(self, x):
        h = self.norm(x)
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)
        x = x + self.proj(att @ v)
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class TinyTransformer(nn.Module):
    def __init__(self, layers=3, d=64, vocab=100):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, x):
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)
