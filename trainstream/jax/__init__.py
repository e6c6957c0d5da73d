"""JAX API: :func:`trainstream.jax._transform.offload_adamw` and :func:`~trainstream.jax._transform.offload_adam`,
optax gradient transformations (:class:`OffloadTransformation`) whose state (:class:`OffloadAdamWState`) lives in
host memory. Needs optax and jax 0.10 or newer (its ``jax.experimental.buffer_callback`` and memory kinds)."""

from ._state import OffloadAdamWState, close, load_state_dict, state_dict
from ._transform import OffloadTransformation, offload_adam, offload_adamw

__all__ = ["OffloadAdamWState", "OffloadTransformation", "close", "load_state_dict", "offload_adam", "offload_adamw",
           "state_dict"]
