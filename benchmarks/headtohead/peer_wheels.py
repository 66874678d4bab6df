#!/usr/bin/env python3
"""Fetches, on a machine with a package index, the wheels compare.py's peer engines
need on the GPU host (which has none), small enough to travel with a device call
(64 MiB per call, the repository and .deps included).

    python3 benchmarks/headtohead/peer_wheels.py --dest .whl              # peers: ~12 MB
    python3 benchmarks/headtohead/peer_wheels.py --dest .whl --unsloth    # + Unsloth: ~33 MB

Sets (versions pinned below; the GPU host's image already has torch 2.11, transformers,
peft, accelerate, numpy, einops, msgpack, ninja, psutil, py-cpuinfo, tqdm, pyarrow,
xxhash, typer, rich and the rest of docs/benchmarks-compare.md's list):

- peers: torchao; DeepSpeed (PyPI has only its sdist: built here into a pure-Python
  wheel with DS_BUILD_OPS=0, its CPU Adam then compiles on first use there, with the
  host's g++ and ninja) with hjson and pydantic (+ pydantic-core, annotated-types,
  typing-inspection, typing-extensions); bitsandbytes, slimmed to the CUDA
  ``--cuda`` library and the CPU one (the wheel carries one library per CUDA release:
  43 MB whole, ~2 MB slimmed).
- --unsloth: unsloth (its ``studio/`` web app left out), unsloth-zoo, trl, datasets<5,
  tyro and the small packages they import. xformers is optional to Unsloth and left out.

pip runs with --no-deps: every package is named here. Needs pip, network, and for the
DeepSpeed build an interpreter with torch (the project's .venv).
"""
from __future__ import annotations

import argparse
import base64
import glob
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64"]
PEERS = ["torchao==0.18.0", "bitsandbytes==0.50.2", "hjson==3.1.0", "pydantic==2.14.3",
         "pydantic-core==2.50.4", "annotated-types==0.8.0", "typing-inspection==0.4.5",
         "typing-extensions==4.16.0"]
DEEPSPEED = "deepspeed==0.19.8"
UNSLOTH = ["unsloth==2026.10.9", "unsloth-zoo==2026.10.9", "trl==1.15.0",
           "datasets<5,!=4.0.*,!=4.1.0,!=4.4.*,!=4.5.0", "tyro", "docstring-parser", "typeguard",
           "shtab", "cut-cross-entropy", "msgspec", "diffusers", "hf-transfer", "json5",
           "structlog", "nest-asyncio", "dill", "multiprocess"]


def download(specs, dest: str, python: str) -> None:
    cmd = [python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
           "3.12", "--implementation", "cp", "-d", dest]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    subprocess.run(cmd + list(specs), check=True)


def build_deepspeed(dest: str, python: str) -> None:
    """DeepSpeed's sdist built into a wheel (no compiled ops)."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([python, "-m", "pip", "download", "--no-deps", "--no-binary=:all:", "-d", tmp,
                        DEEPSPEED], check=True)
        (sdist,) = glob.glob(os.path.join(tmp, "deepspeed-*.tar.gz"))
        shutil.unpack_archive(sdist, tmp)
        src = sdist[:-len(".tar.gz")]
        # Its setup.py imports torch (so no build isolation) and needs a setuptools that
        # makes wheels itself: a recent one beside the interpreter's packages, for this build.
        tools = os.path.join(tmp, "build-tools")
        subprocess.run([python, "-m", "pip", "install", "-q", "--target", tools, "setuptools>=75", "wheel"],
                       check=True)
        env = dict(os.environ, DS_BUILD_OPS="0",
                   PYTHONPATH=os.pathsep.join(filter(None, [tools, os.environ.get("PYTHONPATH")])))
        subprocess.run([python, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", dest, src],
                       check=True, env=env)


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def slim(wheel: str, keep) -> None:
    """Rewrites ``wheel`` in place with only the members ``keep(name)`` accepts (its
    RECORD rewritten to match)."""
    tmp = wheel + ".slim"
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        record = next(n for n in src.namelist() if n.endswith(".dist-info/RECORD"))
        lines = []
        for info in src.infolist():
            if info.filename == record or not keep(info.filename):
                continue
            data = src.read(info)
            dst.writestr(info, data)
            lines.append(_record_line(info.filename, data))
        dst.writestr(record, "\n".join(lines + [f"{record},,"]) + "\n")
    os.replace(tmp, wheel)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dest", default=".whl", help="folder for the wheels (git-ignored; default .whl)")
    ap.add_argument("--cuda", default="130", help="bitsandbytes library to keep: the GPU host's torch's "
                    "CUDA as digits (torch 2.11+cu130: 130)")
    ap.add_argument("--unsloth", action="store_true", help="the Unsloth set too")
    ap.add_argument("--python", default=sys.executable,
                    help="interpreter with torch, for the DeepSpeed build (default: this one)")
    args = ap.parse_args()
    if not args.cuda.isdigit():
        ap.error(f"--cuda {args.cuda!r}: give the CUDA version as digits, e.g. 130 for 13.0")
    os.makedirs(args.dest, exist_ok=True)
    download(PEERS, args.dest, args.python)
    build_deepspeed(args.dest, args.python)
    keep_lib = f"libbitsandbytes_cuda{args.cuda}.so"
    for wheel in glob.glob(os.path.join(args.dest, "bitsandbytes-*.whl")):
        have = [n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(keep_lib)]
        if not have:
            raise SystemExit(f"{wheel} has no {keep_lib}; pick --cuda from its libbitsandbytes_cuda*.so")
        slim(wheel, lambda n: not n.startswith("bitsandbytes/libbitsandbytes_")
             or n.endswith(keep_lib) or n.endswith("libbitsandbytes_cpu.so"))
    if args.unsloth:
        download(UNSLOTH, args.dest, args.python)
        for wheel in glob.glob(os.path.join(args.dest, "unsloth-2*.whl")):
            slim(wheel, lambda n: not n.startswith("studio/"))
    total = 0
    for path in sorted(glob.glob(os.path.join(args.dest, "*.whl"))):
        size = os.path.getsize(path)
        total += size
        print(f"{size / 1e6:8.2f} MB  {os.path.basename(path)}")
    print(f"{total / 1e6:8.2f} MB  in all ({total / 2**20:.1f} MiB of the 64 MiB a call carries)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
