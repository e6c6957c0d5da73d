"""JAX API: ``trainstream.jax.offload_adamw`` (an optax ``GradientTransformation``).

See :func:`trainstream.backends._jax.offload_adamw`. Needs jax and optax.
"""

from .backends._jax import (
    EngineHandle,
    OffloadAdamW,
    OffloadAdamWState,
    close,
    load_state_dict,
    offload_adamw,
    state_dict,
    stats,
)

__all__ = [
    "EngineHandle",
    "OffloadAdamW",
    "OffloadAdamWState",
    "close",
    "load_state_dict",
    "offload_adamw",
    "state_dict",
    "stats",
]
