"""The engine core (no torch, no jax): :class:`Engine` (``_engine.py``: slots with a placement, the adapters' one API)
over the host placement (``_host.py``: slots updated on the worker pool of ``_pool.py``, which also holds the sticky
error record and what ``os.fork()`` leaves) and the device placement (``_device.py``: kernel launches, the staging
ring of ``_ring.py``); ``_budget.py`` sizes and places the state; ``_backend.py`` is what a framework's backend
(``trainstream/backends/``) provides. Both adapters go through the engine: torch registers slots; JAX, whose state
lives in XLA's buffers, has them updated in place by the same placements (``_external.py``:
:meth:`Engine.update_external` on the host workers, :meth:`Engine.launch_external` by the device kernels), on an
engine made without a backend; buffers in GPU memory reach the host workers through the staging ring of
``_hostring.py`` (:class:`HostRing`).
"""

from ._engine import MODES, Backend, DeviceUpdate, Engine, ExternalUpdate, WorkerError, state_bytes
from ._hostring import HostRing, StagedLeaf, host_ring_bytes

__all__ = ["Backend", "DeviceUpdate", "Engine", "ExternalUpdate", "HostRing", "MODES", "StagedLeaf", "WorkerError",
           "host_ring_bytes", "state_bytes"]
