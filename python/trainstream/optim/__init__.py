"""The optimizer: ``OffloadAdamW`` and the backends it runs on."""
from .offload_adamw import OffloadAdamW

__all__ = ["OffloadAdamW"]
