"""JAX API: ``trainstream.jax.offload_adamw`` (an optax ``GradientTransformation``).

See :func:`trainstream.jax._transform.offload_adamw`. Needs jax and optax.
"""

from ._transform import (
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
