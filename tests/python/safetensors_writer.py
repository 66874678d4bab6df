"""A minimal safetensors writer and reader for tests (no `safetensors` package):
8-byte little-endian header length, a JSON header, then the raw bytes."""
from __future__ import annotations

import json
import struct
from typing import Dict, Optional

import torch

DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
          torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
          torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
          torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
TORCH = {v: k for k, v in DTYPES.items()}


def tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous().cpu()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def write_qwen_folder(folder, seed: int = 0):
    """A random-weight Qwen2 model folder (config.json and a bf16 model.safetensors), the
    shape the GPU base tests load; returns the model it saved."""
    import transformers
    cfg = transformers.Qwen2Config(hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=512, vocab_size=512)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    cfg.save_pretrained(folder)
    write_safetensors(f"{folder}/model.safetensors", dict(model.state_dict()))
    return model


def write_safetensors(path, tensors: Dict[str, torch.Tensor],
                      metadata: Optional[Dict[str, str]] = None) -> None:
    header, blobs, offset = {}, [], 0
    if metadata:
        header["__metadata__"] = metadata
    for name, t in tensors.items():
        data = tensor_bytes(t)
        header[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)  # the reference writer pads the header to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for b in blobs:
            f.write(b)


def write_raw(path, header: dict, data: bytes, header_len: Optional[int] = None) -> None:
    """A file with an arbitrary (possibly wrong) header, for bad-input tests."""
    raw = json.dumps(header).encode() if isinstance(header, dict) else header
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw) if header_len is None else header_len))
        f.write(raw)
        f.write(data)


def read_safetensors(path) -> Dict[str, torch.Tensor]:
    """The plain reader the shared base is compared with."""
    with open(path, "rb") as f:
        blob = f.read()
    n, = struct.unpack_from("<Q", blob)
    header = json.loads(blob[8:8 + n])
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        b, end = e["data_offsets"]
        raw = torch.frombuffer(bytearray(blob[8 + n + b:8 + n + end]), dtype=torch.uint8) \
            if end > b else torch.empty(0, dtype=torch.uint8)
        out[name] = raw.view(TORCH[e["dtype"]]).reshape(e["shape"])
    return out


def write_sharded(folder, tensors: Dict[str, torch.Tensor], shards: int) -> None:
    names = list(tensors)
    per = -(-len(names) // shards)
    weight_map = {}
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i * per:(i + 1) * per]}
        write_safetensors(f"{folder}/{fname}", part)
        weight_map.update({n: fname for n in part})
    with open(f"{folder}/model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {"total_size": sum(len(tensor_bytes(t)) for t in tensors.values())},
                   "weight_map": weight_map}, f)
