"""TrainStream: AdamW with its state in host memory, bit-identical to the reference.

Public entry points: ``trainstream.torch.OffloadAdamW`` (a PyTorch optimizer),
``trainstream.jax.offload_adamw`` (an optax ``GradientTransformation``; JAX on the CPU or a
CUDA GPU) and the arithmetic contract, :mod:`trainstream.contract`. ``import trainstream``
needs none of torch, jax or cupy.
"""

from __future__ import annotations

from . import contract
from .contract import CONVENTIONS, PLATFORMS, AdamWHyperParams

__version__ = "0.2.0.dev0"

__all__ = ["AdamWHyperParams", "CONVENTIONS", "PLATFORMS", "contract"]
