"""The engine core: slots with a placement, the adapters' one API (no torch, no jax).

* :class:`Engine` (``core/_engine.py``): register, gradient ready, step, wait ready,
  state out and in, stats, close; ``cpu``/``gpu``/``hybrid`` are placement policies, and
  a budget of GPU memory keeps the first slots' state resident there (:func:`state_bytes`).
* host placement (``core/_host.py``): worker pool and the host update pipeline.
* device placement (``core/_device.py``): zero-copy kernel launches (CuPy on first use),
  the state in mapped host memory or resident in GPU memory.
"""

from ._engine import (
    PLACEMENTS,
    Backend,
    Engine,
    ExternalUpdate,
    WorkerError,
    state_bytes,
)

__all__ = ["Backend", "Engine", "ExternalUpdate", "PLACEMENTS", "WorkerError", "state_bytes"]
