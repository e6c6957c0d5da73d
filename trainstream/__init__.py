"""TrainStream: AdamW with its state in host memory, bit-identical to the reference.

Public entry points:

* ``trainstream.torch.OffloadAdamW`` (PyTorch optimizer)
* ``trainstream.jax.offload_adamw`` (optax ``GradientTransformation``; JAX on the CPU or a CUDA GPU)
* the arithmetic contract: ``trainstream.contract`` (``trainstream.contract``)

``import trainstream`` needs none of torch, jax or cupy; the names below load lazily.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from . import contract
from .contract import CONVENTIONS, PLATFORMS, AdamWHyperParams

__version__ = "0.2.0.dev0"

__all__ = [
    "AdamWHyperParams",
    "CONVENTIONS",
    "PLATFORMS",
    "contract",
]

_LAZY: dict[str, tuple[str, str]] = {}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(import_module(module, __name__), attr)
    raise AttributeError(f"module 'trainstream' has no attribute {name!r}")
