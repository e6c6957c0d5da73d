"""``overlap_forward``'s gate for :class:`~trainstream.torch.OffloadAdamW`: the next forward may start before
the update has finished. A forward pre-hook on every module of the model waits (on the GPU stream, through the
engine's per-slot readiness) for the pending updates of the weights that module reads, outside Dynamo's graphs.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Iterable

import torch

from ._params import Slots

__all__ = ["Gate"]


class Gate:
    """The slots whose update the gated forward still waits for (``pending``), and the forward pre-hooks. Inactive
    (``active`` False: no ``overlap_forward``), :meth:`mark` records nothing. Holds nothing of the optimizer."""

    def __init__(self, slots: Slots, active: bool):
        self.slots, self.active = slots, active
        self.pending: set[int] = set()
        self._lock = threading.Lock()
        self._called: weakref.WeakSet = weakref.WeakSet()  # modules whose forward has run (see _module_slots)
        self._wait_sets: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> the slots it waits for
        self._handles: list = []

    def install(self, model: torch.nn.Module) -> None:
        """Before each module of ``model`` runs, wait for its weights."""
        ref = weakref.ref(self)

        @torch.compiler.disable  # runs eagerly, outside any graph Dynamo traces
        def pre_hook(module: torch.nn.Module, args: Any) -> None:
            gate = ref()
            if gate is not None and not gate.slots.closed:
                gate._wait_for(module)
        for m in model.modules():
            self._handles.append(m.register_forward_pre_hook(pre_hook))

    def _wait_for(self, module: torch.nn.Module) -> None:
        if module not in self._called:
            self._called.add(module)
            self._wait_sets.clear()
        sids = [sid for sid in self._module_slots(module) if sid in self.pending] if self.pending else None
        if sids:
            self.slots.engine.wait_ready(sids)
            with self._lock:
                self.pending.difference_update(sids)

    def _module_slots(self, module: torch.nn.Module) -> list[int]:
        """The slots ``module``'s forward waits for: its own parameters' and those of descendants whose forward
        never runs (e.g. MultiheadAttention reads ``out_proj.weight`` without calling ``out_proj``)."""
        sids = self._wait_sets.get(module)
        if sids is None:
            sids, todo = [], [module]
            while todo:
                mod = todo.pop()
                sids.extend(rec.sid for p in mod._parameters.values() if (rec := self.slots.of(p)) is not None)
                todo.extend(c for c in mod.children() if c not in self._called)
            self._wait_sets[module] = sids
        return sids

    def mark(self, sids: Iterable[int]) -> None:
        """The gated forward waits for these slots' updates."""
        if self.active:
            with self._lock:
                self.pending.update(sids)

    def clear(self) -> None:
        """Nothing is pending any more (every update has landed, or the state was reloaded)."""
        with self._lock:
            self.pending.clear()

    def forget_modules(self) -> None:
        """New parameters were registered: the cached per-module wait lists predate them."""
        self._wait_sets.clear()

    def remove(self) -> None:
        """Remove the forward pre-hooks (once, with the optimizer's other hooks)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
