"""The engine core: slots with a placement, the adapters' one API (no torch, no jax).

* :class:`Engine` (``core/_engine.py``): register, gradient ready, step, wait ready,
  state out and in, stats, close; ``cpu``/``gpu``/``hybrid`` are placement policies, and
  a budget of GPU memory keeps the first slots' state resident there (:func:`state_bytes`).
* host placement (``core/_host.py``): worker pool and the host update pipeline.
* device placement (``core/_device.py``): kernel launches (CuPy on first use), the state
  in pinned host memory (staged through a :class:`StagingRing` of GPU buffers, or read
  over PCIe) or resident in GPU memory.
"""

from ._engine import (
    PLACEMENTS,
    Backend,
    Engine,
    ExternalUpdate,
    WorkerError,
    state_bytes,
)
from ._device import StagingRing, staging_ring

__all__ = ["Backend", "Engine", "ExternalUpdate", "PLACEMENTS", "StagingRing", "WorkerError", "staging_ring",
           "state_bytes"]
