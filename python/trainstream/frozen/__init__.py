"""Frozen weights: quantized storage (quantization.py) and frozen bases shared through
the daemon (shared_base.py). Imported on first use: both load ``trainstream._C``."""
