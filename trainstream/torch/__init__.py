"""PyTorch API: ``trainstream.torch.OffloadAdamW`` (``torch.optim.AdamW``) and ``OffloadAdam`` (``torch.optim.Adam``)."""

from ._optimizer import OffloadAdam, OffloadAdamW

__all__ = ["OffloadAdam", "OffloadAdamW"]
