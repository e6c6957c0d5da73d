"""PyTorch API: ``trainstream.torch.OffloadAdamW``."""

from .backends._torch import OffloadAdamW

__all__ = ["OffloadAdamW"]
