"""PyTorch API: ``trainstream.torch.OffloadAdamW``."""

from ._optimizer import OffloadAdamW

__all__ = ["OffloadAdamW"]
