"""Builds a quant-only ``trainstream._C`` with torch's extension builder, for machines
where the full CMake build cannot run (the GPU host has no gRPC).

    python3 benchmarks/quant/build_quant_ext.py [--out build-quant-ext] [--arch 90]
    PYTHONPATH=build-quant-ext/python:tests/python python3 -m pytest tests/python/test_quant*.py
    PYTHONPATH=build-quant-ext/python python3 benchmarks/quant/bench_quant.py

What it compiles:
  kernels/cpu/quant_*.cc, cpu_features.cc   g++ -O3, each *_avx2 / *_avx512 file with the
                                            same ISA flags as kernels/CMakeLists.txt
  kernels/cuda/quant_*.cu                   nvcc -O3 for sm_<arch> (+ PTX), like CMake
  python/csrc/quant_bindings.cpp            with TRAINSTREAM_WITH_CUDA when CUDA is there
  benchmarks/quant/quant_module.cpp         the module (quant submodule only)
through torch.utils.cpp_extension.load (ninja), then lays out <out>/python/trainstream/
(python/trainstream/*.py plus _C.so), so PYTHONPATH=<out>/python imports it.
"""
import argparse
import glob
import os
import shutil
import subprocess
import sys
import sysconfig
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ISA_FLAGS = {
    "_avx512.cc": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16",
                   "-mfma", "-mf16c", "-mavx2"],
    "_avx2.cc": ["-mavx2", "-mfma", "-mf16c"],
}


def compile_cpu_kernels(obj_dir, abi, jobs):
    """The CPU kernels as objects (per-file ISA flags, which cpp_extension cannot set)."""
    os.makedirs(obj_dir, exist_ok=True)
    sources = sorted(glob.glob(os.path.join(REPO, "kernels/cpu/quant_*.cc")))
    sources.append(os.path.join(REPO, "kernels/cpu/cpu_features.cc"))
    cxx = os.environ.get("CXX", "c++")
    procs, objs = [], []
    for src in sources:
        flags = next((f for suffix, f in ISA_FLAGS.items() if src.endswith(suffix)), [])
        obj = os.path.join(obj_dir, os.path.basename(src) + ".o")
        cmd = [cxx, "-std=c++17", "-O3", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
               "-I", os.path.join(REPO, "kernels/include"), *flags, "-c", src, "-o", obj]
        print(" ".join(cmd), flush=True)
        procs.append(subprocess.Popen(cmd))
        objs.append(obj)
        if len(procs) >= jobs:
            if procs.pop(0).wait() != 0:
                sys.exit("build_quant_ext: a CPU kernel failed to compile")
    for p in procs:
        if p.wait() != 0:
            sys.exit("build_quant_ext: a CPU kernel failed to compile")
    return objs


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(REPO, "build-quant-ext"))
    ap.add_argument("--arch", default="90", help="SM architecture for nvcc (default 90: H100/H200)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--no-cuda", action="store_true", help="CPU kernels and bindings only")
    args = ap.parse_args()

    import torch
    from torch.utils import cpp_extension

    t0 = time.time()
    out = os.path.abspath(args.out)
    build_dir = os.path.join(out, "ext")
    os.makedirs(build_dir, exist_ok=True)
    os.environ.setdefault("MAX_JOBS", str(args.jobs))
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    with_cuda = not args.no_cuda and torch.version.cuda is not None and \
        cpp_extension.CUDA_HOME is not None
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), CUDA_HOME "
          f"{cpp_extension.CUDA_HOME}, ninja {cpp_extension.is_ninja_available()}, "
          f"building with CUDA: {with_cuda}", flush=True)

    objs = compile_cpu_kernels(os.path.join(out, "cpu_obj"), abi, args.jobs)
    sources = [os.path.join(REPO, "benchmarks/quant/quant_module.cpp"),
               os.path.join(REPO, "python/csrc/quant_bindings.cpp")]
    cflags = ["-O3", "-std=c++17"]
    cuda_flags = ["-O3", "-std=c++17", "--expt-relaxed-constexpr",
                  f"-gencode=arch=compute_{args.arch},code=sm_{args.arch}",
                  f"-gencode=arch=compute_{args.arch},code=compute_{args.arch}"]
    if with_cuda:
        sources += sorted(glob.glob(os.path.join(REPO, "kernels/cuda/quant_*.cu")))
        cflags.append("-DTRAINSTREAM_WITH_CUDA=1")
    mod = cpp_extension.load(
        name="_C", sources=sources, extra_cflags=cflags,
        extra_cuda_cflags=cuda_flags if with_cuda else None,
        extra_include_paths=[os.path.join(REPO, "kernels/include")],
        extra_ldflags=objs, build_directory=build_dir, with_cuda=with_cuda, verbose=True)

    pkg = os.path.join(out, "python", "trainstream")
    if os.path.isdir(pkg):
        shutil.rmtree(pkg)
    shutil.copytree(os.path.join(REPO, "python", "trainstream"), pkg,
                    ignore=shutil.ignore_patterns("__pycache__", "_C*.so"))
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    shutil.copy2(mod.__file__, os.path.join(pkg, "_C" + suffix))
    print(f"built {os.path.join(pkg, '_C' + suffix)} (with_cuda={mod.with_cuda}) in "
          f"{time.time() - t0:.0f} s; use PYTHONPATH={os.path.join(out, 'python')}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
