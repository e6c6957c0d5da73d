"""PyTorch API: ``trainstream.torch.OffloadAdamW`` (for ``torch.optim.AdamW``) and ``OffloadAdam`` (``Adam``)."""

from ._optimizer import OffloadAdam, OffloadAdamW

__all__ = ["OffloadAdam", "OffloadAdamW"]
