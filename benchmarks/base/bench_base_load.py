#!/usr/bin/env python3
"""Base-cache load benchmark: writes a Qwen2.5-14B-shaped checkpoint of random
bf16 weights (sharded safetensors + config.json) and loads it through trainstreamd
as NF4 (or another format), printing load throughput (GB/s of checkpoint read)
and the daemon's peak RSS (VmHWM) next to the base segment's size.

    # GPU host (128 GiB RAM, 64 GiB disk): the full 14B shape (~29.5 GB on disk)
    PYTHONPATH=build/python .venv/bin/python benchmarks/base/bench_base_load.py \
        --dir /tmp/ts-bench-14b --clients 2
    # anywhere, small:
    PYTHONPATH=build/python python benchmarks/base/bench_base_load.py --layers 2

Memory: the writer holds one tensor at a time; the daemon holds the base segment
(~10.6 GB at NF4 for 14B) plus one tensor of scratch. ``--clients N`` starts N
processes that map the base and reads every byte, then reports their private
(RssAnon) and shared (RssShmem) growth: the base is counted once.

``--share-vram`` (GPU host) then starts ``--vram-clients`` processes (default 2), one
after the other, that load the base with ``share_vram=True`` on GPU 0, build CUDA
views of every tensor and touch them. Each reports the device's free memory
(cudaMemGetInfo) before and after: the first sees the daemon's one VRAM copy appear
(the base's bytes, plus the daemon's CUDA context), the others grow by far less.

    PYTHONPATH=build/python .venv/bin/python benchmarks/base/bench_base_load.py \
        --dir /tmp/ts-bench-14b --reuse --share-vram
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import textwrap
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def qwen2_tensors(a):
    """(name, shape) in checkpoint order, Qwen2 naming; no ``lm_head.weight`` when
    ``a.tie_word_embeddings`` (optional, default False: the output layer is the
    embedding, as in Qwen2.5-1.5B)."""
    h, kv = a.hidden, a.kv_heads * (a.hidden // a.heads)
    out = [("model.embed_tokens.weight", (a.vocab, h))]
    for i in range(a.layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (h,)),
                (p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.q_proj.bias", (h,)),
                (p + "self_attn.k_proj.weight", (kv, h)), (p + "self_attn.k_proj.bias", (kv,)),
                (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.v_proj.bias", (kv,)),
                (p + "self_attn.o_proj.weight", (h, h)),
                (p + "post_attention_layernorm.weight", (h,)),
                (p + "mlp.gate_proj.weight", (a.intermediate, h)),
                (p + "mlp.up_proj.weight", (a.intermediate, h)),
                (p + "mlp.down_proj.weight", (h, a.intermediate))]
    out += [("model.norm.weight", (h,))]
    if not getattr(a, "tie_word_embeddings", False):
        out += [("lm_head.weight", (a.vocab, h))]
    return out


def numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def write_checkpoint(a, folder):
    os.makedirs(folder, exist_ok=True)
    tensors = qwen2_tensors(a)
    shard_bytes = int(a.shard_gb * 1e9)
    shards, cur, size = [], [], 0
    for name, shape in tensors:
        nbytes = 2 * numel(shape)
        if cur and size + nbytes > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append((name, shape))
        size += nbytes
    shards.append(cur)
    weight_map, total = {}, 0
    total_elems = sum(numel(shape) for _, shape in tensors)
    # Random bf16 values (std 0.02) from a 256 MiB pool, each tensor starting at its own
    # offset: writing is then disk-bound, not random-number-bound.
    # A small checkpoint draws only as many values as it holds.
    gen = torch.Generator().manual_seed(0)
    pool = (torch.randn(min(1 << 27, total_elems), generator=gen) * 0.02).to(torch.bfloat16)
    pool_bytes = memoryview(pool.view(torch.uint8).numpy())
    t0 = time.perf_counter()
    for i, part in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        header, off = {"__metadata__": {"format": "pt"}}, 0
        for name, shape in part:
            n = 2 * numel(shape)
            header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + n]}
            off += n
            weight_map[name] = fname
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(os.path.join(folder, fname), "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            for k, (name, shape) in enumerate(part):
                left = 2 * numel(shape)
                if name.endswith("norm.weight"):
                    f.write(torch.ones(shape, dtype=torch.bfloat16).view(torch.uint8).numpy())
                    continue
                start = (k * 7919 * 4096) % len(pool_bytes)
                while left:
                    n = min(left, len(pool_bytes) - start)
                    f.write(pool_bytes[start:start + n])
                    left -= n
                    start = 0
        total += off
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
              "hidden_size": a.hidden, "intermediate_size": a.intermediate,
              "num_hidden_layers": a.layers, "num_attention_heads": a.heads,
              "num_key_value_heads": a.kv_heads, "vocab_size": a.vocab,
              "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
              "tie_word_embeddings": bool(getattr(a, "tie_word_embeddings", False)),
              "torch_dtype": "bfloat16", "hidden_act": "silu"}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    dt = time.perf_counter() - t0
    print(f"wrote {total / 1e9:.2f} GB in {len(shards)} shards to {folder} in {dt:.1f} s "
          f"({total / 1e9 / dt:.2f} GB/s)", flush=True)
    return total


def proc_status(pid):
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, v = line.split(":", 1)
            if k in ("VmHWM", "VmRSS", "RssAnon", "RssShmem", "RssFile"):
                out[k] = int(v.split()[0]) * 1024
    return out


CLIENT = textwrap.dedent("""
    import json, sys, torch
    from trainstream.frozen.shared_base import load_base
    def st():
        d = {}
        for line in open('/proc/self/status'):
            k, v = line.split(':', 1)
            if k in ('RssAnon', 'RssShmem'):
                d[k] = int(v.split()[0]) * 1024
        return d
    b0 = st()
    base = load_base(sys.argv[1], sys.argv[2], int(sys.argv[3]), socket=sys.argv[4])
    for n in base.names():
        t = base.quantized(n).data if base.is_quantized(n) else base.tensor(n)
        if t.numel():
            t.reshape(-1).view(torch.uint8)[::4096].sum()  # touch every page
    b1 = st()
    print(json.dumps({"anon": b1["RssAnon"] - b0["RssAnon"],
                      "shmem": b1["RssShmem"] - b0["RssShmem"], "key": base.key}), flush=True)
    sys.stdin.readline()
""")

VRAM_CLIENT = textwrap.dedent("""
    import json, sys, time, torch
    from trainstream.frozen.shared_base import load_base
    torch.cuda.init()
    torch.empty(1, device="cuda")        # this process's context exists before measuring
    free0, total = torch.cuda.mem_get_info()
    t0 = time.perf_counter()
    base = load_base(sys.argv[1], sys.argv[2], int(sys.argv[3]), socket=sys.argv[4],
                     share_vram=True)
    share_s = time.perf_counter() - t0
    touched = 0
    for n in base.names():
        t = base.quantized(n, "cuda").data if base.is_quantized(n) else base.tensor(n, "cuda")
        if t.numel():
            touched += int(t.reshape(-1).view(torch.uint8)[::4096].sum())
    torch.cuda.synchronize()
    free1, _ = torch.cuda.mem_get_info()
    dev = torch.cuda.current_device()
    share = {k: v for k, v in base.vram_info[dev].items() if k != "ipc_handle"}
    print(json.dumps({"free_before": free0, "free_after": free1, "total": total,
                      "growth": free0 - free1, "torch_allocated": torch.cuda.memory_allocated(),
                      "load_and_share_s": share_s, "share": share, "touched": touched}),
          flush=True)
    sys.stdin.readline()
""")


def vram_share(a, folder, sock, c, clients, result):
    """--share-vram: N processes on GPU 0 share the daemon's one VRAM copy."""
    env = dict(os.environ)
    reports = []
    for _ in range(a.vram_clients):  # one at a time: each measures the device alone
        p = subprocess.Popen([sys.executable, "-c", VRAM_CLIENT, folder, a.format,
                              str(a.block_size), sock], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=env)
        clients.append(p)
        line = p.stdout.readline()
        if not line:
            raise SystemExit("a --share-vram client failed (see its stderr above)")
        reports.append(json.loads(line))
    base = [b for b in c.list_bases()][0]
    seg = base["segment_bytes"]
    result["share_vram"] = {"base_bytes": seg, "vram_copies": base["vram_copies"],
                            "vram_bytes": base["vram_bytes"], "clients": reports}
    print(f"share_vram: base {seg} bytes ({seg / 2**30:.2f} GiB); daemon VRAM copies "
          f"{base['vram_copies']} ({base['vram_bytes'] / 2**30:.2f} GiB); copy to the GPU "
          f"{reports[0]['share']['copy_seconds']:.2f} s", flush=True)
    for i, r in enumerate(reports):
        print(f"  process {i + 1}: device VRAM growth {r['growth'] / 2**20:.0f} MiB "
              f"({r['growth'] / seg:.3f} x base), cached={r['share']['cached']}, "
              f"holders={r['share']['holders']}, load+share {r['load_and_share_s']:.2f} s",
              flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--hidden", type=int, default=5120)
    ap.add_argument("--intermediate", type=int, default=13824)
    ap.add_argument("--heads", type=int, default=40)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=152064)
    ap.add_argument("--shard-gb", type=float, default=4.0)
    ap.add_argument("--format", default="nf4", choices=["none", "int8", "nf4", "fp8", "nvfp4"])
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--dir", default=None, help="checkpoint folder (default: a temp dir, removed)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint folder")
    ap.add_argument("--reuse", action="store_true", help="reuse a checkpoint already in --dir")
    ap.add_argument("--drop-caches", action="store_true",
                    help="drop the page cache before loading (root): a cold read from disk")
    ap.add_argument("--clients", type=int, default=0,
                    help="processes that then map the base and read it (one copy check)")
    ap.add_argument("--share-vram", action="store_true",
                    help="GPU: processes that load the base with share_vram=True on GPU 0 and "
                         "report the device's VRAM growth (one VRAM copy check)")
    ap.add_argument("--vram-clients", type=int, default=2,
                    help="processes for --share-vram (default 2)")
    ap.add_argument("--budget", default="90%", help="daemon --budget")
    ap.add_argument("--build-dir", default=os.environ.get("TRAINSTREAM_BUILD_DIR",
                                                           os.path.join(REPO, "build")))
    a = ap.parse_args()

    from trainstream import _control as control
    if a.share_vram and not torch.cuda.is_available():
        raise SystemExit("--share-vram needs a CUDA GPU (torch.cuda.is_available() is False)")

    folder = a.dir or tempfile.mkdtemp(prefix="ts-bench-base-")
    if a.reuse and os.path.exists(os.path.join(folder, "model.safetensors.index.json")):
        print(f"reusing {folder}")
    else:
        write_checkpoint(a, folder)
    if a.drop_caches:
        subprocess.run(["sync"], check=True)
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")

    tmp = tempfile.mkdtemp(prefix="ts-bench-daemon-")
    shm = tempfile.mkdtemp(prefix="ts-bench-shm-", dir="/dev/shm")
    sock = os.path.join(tmp, "d.sock")
    log = open(os.path.join(tmp, "d.log"), "w")
    daemon = subprocess.Popen([os.path.join(a.build_dir, "bin", "trainstreamd"), "--foreground",
                               "--socket", sock, "--shm-dir", shm, "--budget", a.budget],
                              stdout=log, stderr=subprocess.STDOUT)
    clients = []
    try:
        deadline = time.time() + 30
        while True:
            try:
                c = control.Client.connect(sock, 500)
                break
            except control.Unavailable:
                if time.time() > deadline or daemon.poll() is not None:
                    raise SystemExit(f"trainstreamd did not start: {open(log.name).read()}") from None
                time.sleep(0.1)
        before = proc_status(daemon.pid)
        last = [0.0]

        def progress(done, total, tdone, ttotal):
            now = time.perf_counter()
            if now - last[0] > 2 or tdone == ttotal:
                last[0] = now
                print(f"  {tdone}/{ttotal} tensors, {done / 1e9:.1f}/{total / 1e9:.1f} GB",
                      flush=True)

        t0 = time.perf_counter()
        info = c.load_base(folder, a.format, a.block_size, progress)
        wall = time.perf_counter() - t0
        after = proc_status(daemon.pid)
        src, seg = info["source_bytes"], info["segment_bytes"]
        result = {
            "shape": {k: getattr(a, k) for k in ("layers", "hidden", "intermediate", "heads",
                                                 "kv_heads", "vocab")},
            "format": a.format, "checkpoint_bytes": src, "segment_bytes": seg,
            "tensors": info["tensors"], "quantized_tensors": info["quantized_tensors"],
            "load_wall_s": round(wall, 3), "load_daemon_s": round(info["load_seconds"], 3),
            "load_GBps": round(src / 1e9 / wall, 3),
            "daemon_VmHWM": after["VmHWM"], "daemon_VmRSS_before": before["VmRSS"],
            "daemon_hwm_minus_segment": after["VmHWM"] - seg,
            "daemon_scratch_peak_bytes": info["scratch_peak_bytes"],
            "page_cache_dropped": a.drop_caches,
        }
        print(f"loaded {src / 1e9:.2f} GB of checkpoint as {a.format} in {wall:.2f} s: "
              f"{src / 1e9 / wall:.2f} GB/s; segment {seg / 2**30:.2f} GiB; daemon VmHWM "
              f"{after['VmHWM'] / 2**30:.2f} GiB (segment + {(after['VmHWM'] - seg) / 2**20:.0f} "
              f"MiB; largest scratch {info['scratch_peak_bytes'] / 2**20:.0f} MiB)", flush=True)
        if a.clients:
            env = dict(os.environ)
            for _ in range(a.clients):
                p = subprocess.Popen([sys.executable, "-c", CLIENT, folder, a.format,
                                      str(a.block_size), sock], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
                clients.append(p)
            reports = [json.loads(p.stdout.readline()) for p in clients]
            status = json.loads(c.status_json())
            base_segments = [s for s in status["segments"] if s["kind"] == "base"]
            result["clients"] = reports
            result["base_segments"] = len(base_segments)
            result["refcount"] = status["bases"][0]["refcount"]
            print(f"{a.clients} clients: base segments {len(base_segments)}, refcount "
                  f"{result['refcount']}; per client private (RssAnon) growth "
                  f"{[round(r['anon'] / 2**20) for r in reports]} MiB, shared (RssShmem) "
                  f"{[round(r['shmem'] / 2**20) for r in reports]} MiB", flush=True)
        if a.share_vram:
            vram_share(a, folder, sock, c, clients, result)
        print("RESULT " + json.dumps(result))
    finally:
        for p in clients:
            try:
                p.stdin.write("\n")
                p.stdin.flush()
                p.wait(timeout=60)
            except Exception:  # noqa: BLE001 (a client that does not exit is killed)
                p.kill()
        daemon.terminate()
        daemon.wait(timeout=60)
        log.close()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
        if not a.dir and not a.keep:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
