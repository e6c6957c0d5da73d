"""The engine: the adapters' one API, over slots (flat parameters), each updated by its placement:
``host`` (:class:`~trainstream.core._host.HostPlacement`) or ``device``
(:class:`~trainstream.core._device.DevicePlacement`). The adapters' modes ``cpu``, ``gpu`` and ``hybrid``
are placement policies (:func:`~trainstream.core._budget.place`); before the policy, in any mode,
``gpu_state_bytes`` keeps the state of the first trainable slots that fit *resident* in GPU memory (the
same kernels, so the same bits). One error record (:class:`~trainstream.core._pool.StickyError`) and one
stats dict. The same placements update buffers the caller owns (:mod:`~trainstream.core._external`):
:meth:`Engine.update_external` on the host, :meth:`Engine.launch_external` on the device; an engine made
without a backend (the JAX adapter's) does only that. Imports neither torch nor jax; no arithmetic
(clipping and loss scaling are the framework's).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from typing import Any, Callable, Sequence

import numpy as np

from .. import contract as C
from ._backend import Backend
from ._budget import WHERE, assign, gpu_state_fits, state_bytes
from ._external import DeviceUpdate, ExternalUpdate
from ._host import HostPlacement
from ._hostslot import STATE_KEYS
from ._pool import StickyError, WorkerError
from ._speculate import EngineSpeculation
from ._stream import EngineStreaming

__all__ = ["Backend", "DeviceUpdate", "Engine", "ExternalUpdate", "MODES", "WorkerError", "state_bytes"]

#: The placement policies (the adapters' ``mode``).
MODES = ("cpu", "gpu", "hybrid")


class Engine(EngineSpeculation, EngineStreaming):
    """Slots, each updated by its placement; slot ids are global, in registration order.

    Args: ``backend``: the framework's (:class:`~trainstream.core._backend.Backend`, and for device slots
    :class:`~trainstream.core._backend.DeviceBackend`); None: no slots, only the external updates over buffers
    the caller owns (``mode="gpu"``: on CUDA device ``device_index``); ``mode``: the policy, ``"cpu"``,
    ``"gpu"`` or ``"hybrid"``; ``device_elems``: ``hybrid``'s budget of elements on the device;
    ``gpu_state_bytes``: the GPU memory for resident state (:func:`state_bytes` per slot; 0: none);
    ``gpu_state_later``: build the device placement now, for :meth:`move_state_to_gpu` later (any mode);
    ``eager_blocks``: grid cap of :meth:`launch_eager` (None: a quarter of the multiprocessors); the
    others are :class:`~trainstream.core._host.HostPlacement`'s.
    """

    def __init__(self, backend: Backend | None, *, mode: str = "cpu", device_elems: int = 0, gpu_state_bytes: int = 0,
                 threads: int | None = None, chunk_size: int | None = None, convention: str = "torch",
                 pin_moments: bool = False, tc_code: int = 0, worker_nice: int = 5, eager_blocks: int | None = None,
                 cores: Sequence[int] | None = None, gpu_state_later: bool = False, device_index: int | None = None,
                 _device: Callable[[], Any] | None = None):
        if mode not in MODES:
            raise ValueError(f"Unknown mode {mode!r}; expected one of {MODES}")
        if convention not in C.CONVENTIONS:
            raise ValueError(f"Unknown convention {convention!r}; expected one of {C.CONVENTIONS}")
        if isinstance(gpu_state_bytes, bool) or not isinstance(gpu_state_bytes, (int, np.integer)) or gpu_state_bytes < 0:
            raise ValueError(f"gpu_state_bytes must be an int >= 0, got {gpu_state_bytes!r}")
        self.backend, self.mode, self.convention, self.eager_blocks = backend, mode, convention, eager_blocks
        self.errors = StickyError()
        self.device = self.host = None
        if mode != "cpu" or gpu_state_bytes > 0 or gpu_state_later:
            if _device is None:
                from ._device import DevicePlacement  # noqa: PLC0415 (CuPy, on first use)
                # Staged in gpu mode only: beside hybrid's host share it was slower (experiments/RESULTS.md).
                self.device = DevicePlacement(backend, convention=convention, staged=mode == "gpu",
                                              device=device_index)
            else:  # tests: a stand-in
                self.device = _device()
        if mode != "gpu":
            try:
                self.host = HostPlacement(backend, threads=threads, chunk_size=chunk_size, convention=convention,
                                          pin_moments=pin_moments, tc_code=tc_code, worker_nice=worker_nice,
                                          errors=self.errors, cores=cores)
            except BaseException:
                if self.device is not None:
                    self.device.close()
                raise
        self._budget = int(device_elems)
        self.device_elems_used = 0  # hybrid: the elements of the device slots that are not resident
        self.gpu_state_budget = int(gpu_state_bytes)  # gpu_state_bytes, raised by move_state_to_gpu
        self.gpu_state_used = 0
        self._where: list[tuple[bool, int]] = []  # slot -> (on the device, id in its placement)
        self._numel: list[int] = []
        self._args: list[list] = []  # slot -> [param, dtype, platform, trainable, recipe] (move_state_to_gpu)
        self._gpu_state: list[int] = []  # slot -> bytes of its resident state (0: not resident)

    @property
    def closed(self) -> bool:
        return any(p.closed for p in self._placements())

    @property
    def threads(self) -> int:
        return self.host.threads if self.host is not None else 0

    def _placements(self) -> list[Any]:
        return [p for p in (self.device, self.host) if p is not None]

    def add_param(self, param: Any, numel: int, dtype: str, platform: str, *, trainable: bool = True,
                  on_device: bool | None = None, where: str | None = None,
                  recipe: C.TorchRecipe | None = None, grad_sums: bool | None = None, streamed: bool = False) -> int:
        """Register a flat parameter; returns its slot id. ``recipe`` (:class:`~trainstream.contract.TorchRecipe`,
        torch convention): the slot's arithmetic and state layout; None: :func:`~trainstream.contract.default_recipe`
        (the fp32-master scheme, without fp32 gradient sums; a recipe with ``master`` keeps them, for
        ``offload_grad(accumulate=True)``; ``grad_sums=False``: a host slot without them). ``streamed``: a host slot
        with bounded staging (:mod:`~trainstream.core._stream`; no gradient sums), updated by :meth:`step` with its
        gradient or by :meth:`stream_update`.
        ``where`` (:data:`~trainstream.core._budget.WHERE`): the adapter's answer
        from :func:`~trainstream.core._budget.assign` for this slot, taken as it is (it asked with
        :attr:`device_elems_used` and :attr:`gpu_state_used` as they are now). ``None``: asked here for this slot
        alone: resident where its state fits in what is left of ``gpu_state_bytes``, else by the policy
        (``on_device``: ``hybrid``'s choice for it). A recipe the device kernels do not implement on the device:
        ``NotImplementedError``."""
        if self.backend is None:
            raise RuntimeError("TrainStream engine: this engine has no framework backend; it updates buffers the "
                               "caller owns (update_external, launch_external), it holds no parameters")
        sums = recipe is not None and recipe.master and dtype != "float32" and grad_sums is not False and not streamed
        if self.convention == "torch":
            recipe = C.check_recipe(recipe if recipe is not None else C.default_recipe(platform, dtype))
        elif recipe is not None:
            raise ValueError("add_param: a TorchRecipe needs the torch convention")
        if where is None:
            where = assign([(numel, dtype, trainable, recipe)], self.mode, device_elems=self._budget,
                           device_used=self.device_elems_used, gpu_state_bytes=self.gpu_state_budget,
                           gpu_state_used=self.gpu_state_used, on_device=[on_device])[0]
        if where not in WHERE:
            raise ValueError(f"add_param: where must be one of {WHERE}, got {where!r}")
        placement = self.host if where == "host" else self.device
        if placement is None:
            raise ValueError(f"add_param: where={where!r} needs the {'host' if where == 'host' else 'device'} "
                             f"placement, which this engine (mode={self.mode!r}) does not have")
        if where != "host" and not self._device_supports(recipe, platform, dtype):
            raise NotImplementedError(f"TrainStream: the GPU kernels do not implement {recipe} yet; update it on the "
                                      "host (mode='cpu', no gpu_state_bytes)")
        need = state_bytes(numel, dtype, recipe) if where == "gpu_state" else 0
        if need:
            local = self.device.add_param(param, numel, dtype, platform, gpu_state=True, **self._dev_kw(recipe))
            self.gpu_state_used += need
        elif where == "host":
            local = placement.add_param(param, numel, dtype, platform, recipe, sums, streamed)
        else:
            local = placement.add_param(param, numel, dtype, platform, **self._dev_kw(recipe))
            self.device_elems_used += int(numel)
        self._where.append((where != "host", local))
        self._numel.append(int(numel))
        self._args.append([param, dtype, platform, trainable, recipe])
        self._gpu_state.append(need)
        return len(self._where) - 1

    def _device_supports(self, recipe: C.TorchRecipe | None, platform: str, dtype: str) -> bool:
        """Whether the device placement updates ``recipe``'s slots: its ``supports(recipe)`` where it has one, else
        the default recipe only (the fp32-master scheme its kernels implemented before recipes)."""
        fn = getattr(self.device, "supports", None)
        if recipe is None or fn is not None:
            return recipe is None or bool(fn(recipe))
        return recipe == C.default_recipe(platform, dtype)

    def _dev_kw(self, recipe: C.TorchRecipe | None) -> dict:
        """The device placement's ``add_param`` takes ``recipe=`` where it has ``supports``."""
        return {"recipe": recipe} if hasattr(self.device, "supports") else {}

    def set_recipe(self, sid: int, recipe: C.TorchRecipe) -> None:
        """Slot ``sid``'s updates from now on follow ``recipe`` (torch's param-group edits and loaded groups: another
        implementation, ``maximize``, a Tensor ``lr``, Adam's L2), whose state layout must be the slot's (platform,
        dtype, ``master``, ``amsgrad``: else ``ValueError``); one the device kernels lack: ``NotImplementedError``."""
        self._check_sid(sid)
        recipe, old = C.check_recipe(recipe), self._args[sid][4]
        layout = ("platform", "dtype", "master", "amsgrad")
        if old is None or any(getattr(old, k) != getattr(recipe, k) for k in layout):
            raise ValueError(f"set_recipe: slot {sid}'s state is laid out for {old}, not for {recipe} (only the "
                             "arithmetic may change: impl, maximize, decoupled, lr_tensor)")
        placement, local = self._local(sid)
        if placement is self.device and not (self._device_supports(recipe, recipe.platform, recipe.dtype)
                                             and hasattr(self.device, "set_recipe")):
            raise NotImplementedError(f"TrainStream: the GPU kernels do not implement {recipe}; it is updated on "
                                      "the GPU, so its recipe cannot become that one")
        placement.set_recipe(local, recipe)
        self._args[sid][4] = recipe

    def on_device(self, sid: int) -> bool:
        """Whether slot ``sid`` is updated by the device placement (resident or not)."""
        return self._where[self._check_sid(sid)][0]

    def has_gpu_state(self, sid: int) -> bool:
        """Whether slot ``sid``'s state is resident in GPU memory."""
        return self._gpu_state[self._check_sid(sid)] > 0

    def _check_sid(self, sid: int) -> int:
        if not isinstance(sid, (int, np.integer)) or not 0 <= sid < len(self._where):
            raise IndexError(f"TrainStream engine: no parameter slot {sid!r}")
        return int(sid)

    def _local(self, sid: int) -> tuple[Any, int]:
        dev, local = self._where[self._check_sid(sid)]
        return (self.device if dev else self.host), local

    def _local_on(self, sid: int, device: bool) -> int:
        """Slot ``sid``'s id in its placement, which must be the device's if ``device``, else the host's."""
        dev, local = self._where[self._check_sid(sid)]
        if dev != device:
            on, off = ("device", "host") if dev else ("host", "device")
            raise RuntimeError(f"TrainStream engine: slot {sid} is updated on the {on}, not on the {off}")
        return local

    def truncate(self, n: int) -> None:
        """Drop the slots registered after the first ``n`` (a failed registration)."""
        keep, drop = self._where[:n], self._where[n:]
        for placement, dev in ((self.host, False), (self.device, True)):
            if placement is not None:  # after move_state_to_gpu a dropped slot's local id may precede a kept one's
                end = 1 + max((local for d, local in keep if d == dev), default=-1)
                for local in sorted(local for d, local in drop if d == dev and local < end):
                    placement.release(local)
                placement.truncate(end)
        self.device_elems_used -= sum(k for (d, _), k, r in zip(self._where[n:], self._numel[n:], self._gpu_state[n:])
                                      if d and not r)
        self.gpu_state_used -= sum(self._gpu_state[n:])
        for per_slot in (self._where, self._numel, self._args, self._gpu_state):
            del per_slot[n:]

    def release(self, sid: int) -> None:
        """Free slot ``sid``'s state once its queued work has run (its parameter left the optimizer); the id stays
        taken by an empty slot, which no later call may name."""
        placement, local = self._local(sid)
        placement.release(local)
        if self._where[sid][0] and not self._gpu_state[sid]:
            self.device_elems_used -= self._numel[sid]
        self.gpu_state_used -= self._gpu_state[sid]
        self._gpu_state[sid] = 0
        self._args[sid][0], self._args[sid][3] = None, False  # move_state_to_gpu leaves it

    def move_state_to_gpu(self, nbytes: int) -> list[int]:
        """Raise the resident budget by ``nbytes`` and move into GPU memory, from either placement, the state
        of the trainable slots not resident yet that fits in what is left of it, in slot order; each keeps its
        id, state and bits. Slots registered later take what is left. Where an allocation is refused, the
        slots moved so far stay moved and the rest stay, with a warning. Returns the slots moved."""
        if self.device is None:
            raise RuntimeError("TrainStream engine: move_state_to_gpu needs the device placement (gpu_state_later=True)")
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)) or nbytes < 0:
            raise ValueError(f"move_state_to_gpu: nbytes must be an int >= 0, got {nbytes!r}")
        self.errors.check()
        todo = [sid for sid, (r, a) in enumerate(zip(self._gpu_state, self._args))
                if not r and a[3] and self._device_supports(a[4], a[2], a[1])]
        self.gpu_state_budget += int(nbytes)
        fits = gpu_state_fits([(self._numel[sid], self._args[sid][1], True, self._args[sid][4]) for sid in todo],
                              self.gpu_state_budget, self.gpu_state_used)
        moved: list[int] = []
        for sid in (s for s, fit in zip(todo, fits) if fit):
            placement, local = self._local(sid)
            param, dtype, platform, _, recipe = self._args[sid]
            st = self.state(sid, copy=False)  # once its queued work has run (a master where the slot keeps one)
            try:
                new = self.device.add_param(param, self._numel[sid], dtype, platform, gpu_state=True, init=False,
                                            **self._dev_kw(recipe))
            except MemoryError as exc:
                self.gpu_state_budget = self.gpu_state_used  # later slots are not resident either
                warnings.warn(f"TrainStream: GPU memory for the state of slot {sid} was refused ({exc}); it and the "
                              "slots after it stay where they were", RuntimeWarning, stacklevel=2)
                break
            try:
                self.device.load_state(new, st)
            except BaseException:
                self.device.truncate(new)
                raise
            # the bookkeeping first: a failure to free the old buffers leaves it right
            if placement is self.device:
                self.device_elems_used -= self._numel[sid]
            self._where[sid] = (True, new)
            self._gpu_state[sid] = state_bytes(self._numel[sid], dtype, recipe)
            self.gpu_state_used += self._gpu_state[sid]
            moved.append(sid)
            placement.release(local)
        return moved

    def get_step(self, sid: int) -> int:
        placement, local = self._local(sid)
        return placement.get_step(local)

    def offload_grad(self, sid: int, grad: Any, grad_dtype: str, update: C.AdamWHyperParams | None = None,
                     accumulate: bool = False, speculate: bool = False, upload: bool = True, coef: float = 1.0,
                     grad_div: float | None = None) -> None:
        """Take the gradient of host slot ``sid``, replacing the one taken before, or with ``accumulate`` adding it
        into the slot's fp32 sum (a slot registered with a ``master`` recipe of fp16/bf16 weights); with ``update``
        (the eager path: last micro-batch, no clipping) queue its update right behind it; with ``speculate`` too, a
        speculative update (:mod:`~trainstream.core._speculate`: :meth:`commit` or :meth:`rollback` at the step;
        ``upload``: its weights uploaded at once, else at :meth:`commit`; ``coef``, ``grad_div``: the multiplier and
        GradScaler division it assumes, as :meth:`step`'s)."""
        self.host.offload_grad(self._local_on(sid, False), grad, grad_dtype, update, accumulate, speculate, upload,
                               coef, grad_div)

    def grad_sum(self, sid: int) -> np.ndarray | None:
        """Host slot ``sid``'s fp32 gradient sum (``offload_grad(accumulate=True)``) once its queued work has run,
        the buffer itself (the adapter scales it in place as the framework scales gradients), or None where the
        slot's staged gradient is not a sum."""
        return self.host.grad_sum(self._local_on(sid, False))

    def discard_grads(self) -> None:
        """Forget the gradients offloaded since the last step (``zero_grad``)."""
        if self.host is not None:
            self.host.discard_grads()

    def launch_eager(self, updates: Sequence[tuple[int, C.AdamWHyperParams, Any, str]]) -> None:
        """Launch the update of device slots whose gradients backward has just produced (from a
        gradient hook: no clipping); :meth:`step` then leaves them out."""
        self.device.step([(self._local_on(sid, True), hp, g, gd) for sid, hp, g, gd in updates],
                         eager=True, max_blocks=self.eager_blocks)

    def step(self, updates: Sequence[tuple], coefs: dict[int, float] | None = None,
             grad_div: dict[int, float] | None = None) -> None:
        """Queue the update of each ``(slot, hyper-parameters)`` (host slots; those without a gradient are
        skipped) or ``(slot, hyper-parameters, grad tensor, grad dtype)`` (device slots; a host slot ignores
        the last two). ``coefs``: per host slot, the multiplier of its staged gradient; ``grad_div``: per slot of a
        fused recipe, GradScaler's scale its gradient is divided by (``found_inf``: leave the slot out of
        ``updates``, as torch's fused step skips it and its step count). With both placements
        the share holding the lowest slot (needed first by the next forward) is queued first; if the second
        share then fails to queue, the error is raised and left sticky (reload a checkpoint)."""
        self.errors.check()  # raise before anything is queued, not between the shares
        where = [self._where[self._check_sid(u[0])] for u in updates]
        dev = [(local, *u[1:]) for u, (d, local) in zip(updates, where) if d]
        hst = [(local, *u[1:]) for u, (d, local) in zip(updates, where) if not d]  # streamed: with its gradient
        if coefs is not None:
            coefs = {self._where[sid][1]: c for sid, c in coefs.items() if not self._where[self._check_sid(sid)][0]}
        dev_div = {}
        if grad_div:
            dev_div = {self._where[sid][1]: c for sid, c in grad_div.items() if self._where[self._check_sid(sid)][0]}
            grad_div = {self._where[sid][1]: c for sid, c in grad_div.items() if not self._where[sid][0]}
        if self.host is None:
            return self.device.step(dev, grad_div=dev_div)
        if self.device is None:
            return self.host.step(hst, coefs, grad_div=grad_div)
        self.device.check_grads(dev)  # a bad gradient raises before either share is queued
        # Host slots this step updates (frozen, unused and eagerly updated parameters hold no gradient).
        host_sids = [u[0] for u, (d, local) in zip(updates, where) if not d and (self.host.has_grad(local) or
                                                                                    self.host.streamed(local))]
        dev_sids = [u[0] for u, (d, _) in zip(updates, where) if d]
        if not host_sids or (dev_sids and min(dev_sids) < min(host_sids)):
            if dev:
                self.device.step(dev, grad_div=dev_div)
            return self.host.step(hst, coefs, check_errors=False, grad_div=grad_div)
        self.host.step(hst, coefs, check_errors=False, grad_div=grad_div)
        try:
            if dev:
                self.device.step(dev, grad_div=dev_div)
        except BaseException as exc:
            self.errors.record(RuntimeError("hybrid step: the device share's update failed after the host share's "
                                            f"was queued ({type(exc).__name__}: {exc})"))
            raise

    def update_external(self, items: Iterable[ExternalUpdate], platform: str,
                        released: Callable[[int], None] | None = None) -> None:
        """The AdamW update of each :class:`~trainstream.core._external.ExternalUpdate` (buffers the caller owns)
        on the host workers, reproducing ``platform``'s arithmetic (``"cpu"``/``"cuda"``); blocks until done
        (:meth:`trainstream.core._host.HostPlacement.update_external`: items may come from an iterator)."""
        self._only("update_external", self.host, "host").update_external(items, platform, released)

    def launch_external(self, items: Sequence[DeviceUpdate], stream: int) -> None:
        """The AdamW update of each :class:`~trainstream.core._external.DeviceUpdate` (buffers the caller owns) by
        the CUDA kernels, queued on ``stream``; returns once queued
        (:meth:`trainstream.core._device.DevicePlacement.launch_external`)."""
        self._only("launch_external", self.device, "device").launch_external(items, stream)

    def _only(self, what: str, placement: Any, name: str):
        if placement is None:
            raise RuntimeError(f"TrainStream engine: {what} runs on the {name} placement, and this engine has none "
                               f"(mode={self.mode!r})")
        return placement

    def wait_ready(self, sids: Sequence[int]) -> None:
        """Make the compute stream wait until the new weights of ``sids`` are in place."""
        where = [self._where[self._check_sid(s)] for s in sids]
        for placement, on_dev in ((self.device, True), (self.host, False)):
            if ids := [local for d, local in where if d == on_dev]:
                placement.wait_ready(ids)

    def check_error(self) -> None:
        """Raise the sticky :class:`~trainstream.core._host.WorkerError`, if any."""
        self.errors.check()

    def clear_error(self) -> None:
        """Forget a failure (after the whole state has been reloaded)."""
        self.errors.clear()

    def drain(self) -> None:
        """Block until every queued update and upload has completed (raises nothing)."""
        for p in self._placements():
            p.drain()

    def synchronize(self) -> None:
        """Block until every queued update and upload has completed; raise failures."""
        self.drain()
        self.errors.check()

    def wait_step(self) -> None:
        """Make the compute stream wait until every update queued so far has landed in the
        parameters (no host block where the backend can wait on the device)."""
        if self.host is not None:
            self.host.wait_step()
        if self.device is not None:
            self.device.wait_all()

    def state(self, sid: int, copy: bool = True) -> dict[str, Any]:
        """Slot ``sid``'s state once its queued work is done: ``step`` (int); ``exp_avg``, ``exp_avg_sq`` and with
        amsgrad ``max_exp_avg_sq``, flat, in the recipe's :func:`~trainstream.contract.state_dtype` (float32, or the
        uint16 bits of fp16/bf16); ``master`` (float32) for a master of fp16/bf16 weights. Copies, or with
        ``copy=False`` a host slot's buffers themselves (a device slot's: copies)."""
        placement, local = self._local(sid)
        return placement.state(local, copy)

    def reload_param(self, sid: int, param: Any = None) -> None:
        """:meth:`trainstream.core._host.HostPlacement.reload_param`: weights changed outside."""
        placement, local = self._local(sid)
        placement.reload_param(local, param)
        if param is not None:
            self._args[sid][0] = param

    def load_state(self, sid: int, state: Mapping) -> None:
        """Replace the state of slot ``sid`` by ``state`` (:meth:`state`'s keys; a float array is cast to the
        state dtype as torch's ``load_state_dict`` casts it, uint16 arrays are fp16/bf16 bits). Everything is
        checked before anything changes: keys, sizes, ``step``. Without ``master`` a master is re-read from the
        weights; without a master the weights' own bits are."""
        self._check_sid(sid)
        if not isinstance(state, Mapping):
            raise TypeError(f"load_state: expected a dict of the slot's state, got {type(state).__name__}")
        recipe = self._args[sid][4]
        need = ["step", "exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if recipe is not None and recipe.amsgrad else [])
        if missing := [k for k in need if k not in state]:
            raise ValueError(f"load_state: the state of parameter slot {sid} lacks {missing[0]!r}")
        if unknown := [k for k in state if k not in STATE_KEYS]:
            raise ValueError(f"load_state: unknown state key {unknown[0]!r} (expected {STATE_KEYS})")
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master"):
            if state.get(key) is not None and np.asarray(state[key]).size != self._numel[sid]:
                raise ValueError(f"load_state: {key} of parameter slot {sid} has {np.asarray(state[key]).size} "
                                 f"elements, expected {self._numel[sid]}")
        step = state["step"]
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"load_state: step must be a non-negative integer, got {step!r}")
        placement, local = self._local(sid)
        if placement is self.host:
            placement.load_state(local, state)
        else:
            self.device.load_state(local, state)

    def stats(self) -> dict[str, float]:
        """Counters (bytes, milliseconds, counts). ``gpu_mode``: 0 host only, 1 device only, 0.5 both; with
        both also ``gpu_params``, ``gpu_numel``, ``gpu_update_launch_ms_total`` (the device share's).
        ``host_state_bytes``: the state in host memory; ``gpu_state_bytes``: the resident state
        (``gpu_state_params`` slots, ``gpu_state_numel`` elements); ``staging_ring_bytes``: the staging ring's.
        Speculation (host slots, :mod:`~trainstream.core._speculate`): ``spec_updates`` (of them
        ``spec_uploads_early``: their weights uploaded at once, during backward), ``spec_committed``,
        ``spec_rolled_back`` (slots), ``spec_steps_committed``, ``spec_steps_redone`` (steps), ``redo_ms_total``
        (the rolled-back updates' time and the restores'), ``spec_backup_bytes`` (the kept copies)."""
        if self.host is None:
            return self.device.stats()
        st = dict(self.host.stats())
        if self.device is None:
            return {**st, "gpu_state_bytes": 0.0, "gpu_state_params": 0.0, "gpu_state_numel": 0.0,
                    "staging_ring_bytes": 0.0}
        g = self.device.stats()
        for k in ("params", "numel", "host_state_bytes", "pinned_state_bytes", "ready_stall_ms_total", "eager_updates"):
            st[k] += g[k]
        st.update({k: g[k] for k in ("gpu_state_bytes", "gpu_state_params", "gpu_state_numel", "staging_ring_bytes")},
                  gpu_mode=0.5, steps=max(st["steps"], g["steps"]), gpu_params=g["params"], gpu_numel=g["numel"],
                  gpu_update_launch_ms_total=g["update_ms_total"])
        return st

    def close(self) -> None:
        """Drain the queued work, stop the workers and release the state."""
        try:
            if self.device is not None:
                self.device.close()
        finally:
            if self.host is not None:
                self.host.close()
