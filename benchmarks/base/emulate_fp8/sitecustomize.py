"""Runs a whole Python process with QuantLinear's FP8 tensor-core path emulated
(``diag_fp8_fit.emulated_fp8``: row-wise ``torch._scaled_mm`` in fp32, the eager
activation quantizer), on any device. Put this folder first on PYTHONPATH; child
processes inherit it, so compare.py's engines run on the path too:

    PYTHONPATH=benchmarks/base/emulate_fp8:build/python python benchmarks/compare.py \\
        --tiny --scenarios lora14b --engines trainstream_fp8

A diagnostic for the CPU machine (the FP8 base's slower fit, docs/benchmarks-compare.md): the FP8 path through
load_model, wrap() and PEFT, where no GPU takes it."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from diag_fp8_fit import emulated_fp8  # noqa: E402

_EMULATION = emulated_fp8()
_EMULATION.__enter__()  # for the life of the process
