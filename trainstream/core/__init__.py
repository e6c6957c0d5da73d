"""The engine core (no torch, no jax): :class:`Engine` (``_engine.py``: slots with a placement, the
adapters' one API) over the host placement (``_host.py``: worker pool, host update pipeline) and the
device placement (``_device.py``: kernel launches, :class:`StagingRing`); ``_budget.py`` sizes the state.
"""

from ._engine import MODES, Backend, Engine, ExternalUpdate, WorkerError, state_bytes
from ._device import StagingRing, staging_ring

__all__ = ["Backend", "Engine", "ExternalUpdate", "MODES", "StagingRing", "WorkerError", "staging_ring",
           "state_bytes"]
