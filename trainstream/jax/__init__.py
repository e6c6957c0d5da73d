"""JAX API: :func:`trainstream.jax._transform.offload_adamw`, an optax ``GradientTransformation``. Needs optax and
jax 0.10 or newer (its ``jax.experimental.buffer_callback`` and memory kinds)."""

from ._transform import OffloadAdamW, OffloadAdamWState, close, load_state_dict, offload_adamw, state_dict

__all__ = ["OffloadAdamW", "OffloadAdamWState", "close", "load_state_dict", "offload_adamw", "state_dict"]
