"""The device placement of the engine: AdamW updated by CUDA kernels (:mod:`trainstream._device_kernels`; several
parameters per launch at ``step``, one from a gradient hook) that read the gradient in GPU memory and write the weights
in place, with the contract's arithmetic: of its slots, or of buffers the caller owns
(:meth:`DevicePlacement.launch_external`, no slot: the JAX adapter's ``mode="gpu"``).

Each slot has a recipe (:class:`~trainstream._device_recipes.TorchRecipe`: torch's foreach, single-tensor or fused
arithmetic on CUDA, state in the weights' dtype or fp32 with a master; :mod:`trainstream._device_recipes`). Its state
(``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq`` with amsgrad, the fp32 master of a master recipe's fp16/bf16 weights;
:mod:`trainstream.core._device_state`) lives in mapped pinned host memory, or for a slot added ``resident`` in GPU
memory (``gpu_state_bytes``; the same kernels, so the same bits). Host state is
*staged* (:class:`~trainstream.core._ring.StagingRing`: 0.99 of the bidirectional PCIe rate) or read by the kernel over
PCIe (*zero-copy*: 0.83; H200, experiments/RESULTS.md); the engine stages in ``gpu`` mode only.

Ordering: the update stream waits for the compute stream at ``step`` (with ``eager``, for the part of backward that
produced the gradient); each launch records a *ready* event that the next forward waits on; each gradient is kept alive
until that wait. External updates run on the caller's stream, in its order. Imports neither torch nor jax.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Mapping
from typing import Any, Sequence

import numpy as np

from .. import _cuda
from .. import _device_recipes as R
from .. import contract as C
from ._backend import DeviceBackend
from ._budget import _ITEMSIZE
from ._device_state import GpuSlot, alloc_buf, check_state, read_buf, to_storage, write_buf
from ._external import DeviceUpdate, device_groups
from ._ring import StagingRing, staging_ring

__all__ = ["DevicePlacement"]

#: Grid of an eager update kernel (launched during backward), in blocks per multiprocessor: backward keeps
#: most of the GPU (experiments/RESULTS.md: 131 ms per step against 156 with the full grid).
EAGER_SM_FRACTION = 0.25

#: Elements of one multi-tensor launch of ``step()`` (a larger tensor goes alone): ~1 ms of PCIe
#: traffic for bf16 weights, ~20x a launch's host cost, and the next forward starts after a few tensors.
MULTI_LAUNCH_ELEMS = 1 << 22


class DevicePlacement:
    """The device slots (module docstring). ``staged``: host-memory state goes through the staging ring, allocated at
    the first update (False: zero-copy, also once the ring's memory was refused); fixed before the first update, as a
    ring once made stays in use (zero-copy launches do not wait for its copies back).

    ``backend``: a :class:`~trainstream.core._backend.DeviceBackend`; None: no slots, only :meth:`launch_external`
    on CUDA device ``device``.
    """

    def __init__(self, backend: DeviceBackend | None, *, convention: str = "torch", staged: bool = True,
                 device: int | None = None):
        from .. import _device_kernels as dk  # CuPy is imported here, on first use
        if convention not in C.CONVENTIONS:
            raise ValueError(f"Unknown convention {convention!r}; expected one of {C.CONVENTIONS}")
        if backend is None and device is None:
            raise ValueError("DevicePlacement without a backend needs its CUDA device")
        self._dk, self.backend, self.convention = dk, backend, convention
        self.device = int(backend.device_index if backend is not None else device)
        dk.compile_kernels(self.device)
        self._eager_grid = max(1, int(dk.multiprocessor_count(self.device) * EAGER_SM_FRACTION))
        self._slots: list[GpuSlot] = []
        self.closed = False
        self._steps = self._eager_updates = 0
        self._launch_s = self._ready_stall_s = 0.0
        self._unwaited = False  # launches since the compute stream last waited for all
        self.staged = bool(staged)
        self._ring: StagingRing | None = None
        self._ring_lock = threading.Lock()  # external updates may come from several threads

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("TrainStream engine is closed")

    @staticmethod
    def _release(bufs) -> None:
        for buf in bufs:
            if buf is not None:
                buf.host = None  # drop the view before the memory goes
                buf.free()

    def add_param(self, param: Any, numel: int, dtype: str, platform: str, *, gpu_state: bool = False,
                  init: bool = True, recipe=None) -> int:
        """Register a flat parameter; returns its slot id. ``gpu_state``: its state in GPU memory. ``init`` False:
        the state is left unset, for the caller's :meth:`load_state`. ``recipe``
        (:class:`~trainstream._device_recipes.TorchRecipe`, convention torch only): the slot's arithmetic and state
        layout; None: torch's foreach arithmetic on an fp32 master (the ``master_weights`` scheme). A recipe the
        kernels do not run raises ``NotImplementedError`` naming it."""
        self._check_open()
        if self.backend is None:
            raise RuntimeError("TrainStream engine: this engine has no framework backend; it updates buffers the "
                               "caller owns (launch_external), it holds no parameters")
        if platform != "cuda":
            raise ValueError("gpu_state_bytes needs CUDA parameters (the state and the update are on the GPU)"
                             if gpu_state else "gpu mode needs CUDA parameters (the update runs on the GPU)")
        if dtype not in _ITEMSIZE:
            raise TypeError(f"TrainStream supports float32, float16 and bfloat16 parameters, got {dtype}")
        if self.convention != "torch":
            if recipe is not None:
                raise ValueError(f"a recipe ({recipe!r}) is torch's; this placement computes {self.convention}")
            sd, ams, master = "float32", False, dtype != "float32"
        else:
            recipe = R.TorchRecipe("foreach", "cuda", dtype, master=True) if recipe is None else recipe
            R.check_recipe(recipe)
            if recipe.dtype != dtype:
                raise ValueError(f"{recipe!r} is for {recipe.dtype} parameters, this one is {dtype}")
            sd, ams = R.state_dtype(recipe), bool(recipe.amsgrad)
            master = sd == "float32" and dtype != "float32"
        owned: list = []
        try:
            m = alloc_buf(self._dk, self.device, numel, sd, "adamw.exp_avg", owned, gpu_state)
            v = alloc_buf(self._dk, self.device, numel, sd, "adamw.exp_avg_sq", owned, gpu_state)
            vmax = alloc_buf(self._dk, self.device, numel, sd, "adamw.max_exp_avg_sq", owned, gpu_state) if ams \
                else None
            mw = alloc_buf(self._dk, self.device, numel, "float32", "adamw.master_fp32", owned, gpu_state) if master \
                else None
            for buf in (m, v, vmax) if init else ():
                if buf is None:
                    continue
                if gpu_state:
                    buf.mem.zero(self.backend.update_stream())
                else:
                    buf.host[:] = 0
            if mw is not None and init:
                weights = mw.host if not gpu_state else np.empty(numel, np.float32)
                self.backend.param_to_host_f32(param, weights)
                if gpu_state:
                    write_buf(mw, weights, self.backend.update_stream())
        except BaseException:
            self._release(owned)  # nothing leaks from a half-built slot
            raise
        self._slots.append(GpuSlot(len(self._slots), param, int(numel), dtype, recipe, m, v, vmax, mw))
        return len(self._slots) - 1

    def has_gpu_state(self, sid: int) -> bool:
        """Whether slot ``sid``'s state is in GPU memory."""
        return self._slot(sid).exp_avg.mem is not None

    def _slot(self, sid: int) -> GpuSlot:
        if not 0 <= sid < len(self._slots):
            raise IndexError(f"TrainStream engine: no parameter slot {sid!r}")
        return self._slots[sid]

    def truncate(self, n: int) -> None:
        """Drop (and free) the slots registered after the first ``n``."""
        for s in self._slots[n:]:
            self._release(s.bufs().values())
        del self._slots[n:]

    def release(self, sid: int) -> None:
        """As :meth:`trainstream.core._host.HostPlacement.release`."""
        self._check_open()
        s = self._slot(sid)
        s.settle()
        self._release(s.bufs().values())
        s.exp_avg = s.exp_avg_sq = s.max_exp_avg_sq = s.master = None  # type: ignore[assignment]
        s.grad_keep = s.ready = s.copied_back = None

    def get_step(self, sid: int) -> int:
        return self._slot(sid).step

    def check_grads(self, updates: Sequence[tuple[int, Any, Any, str]]) -> None:
        """Raise for an unknown slot or a gradient dtype the kernels do not take."""
        for sid, _, _, gdtype in updates:
            self._slot(sid)
            if gdtype not in _ITEMSIZE:
                raise TypeError(f"gradient of parameter slot {sid} has unsupported dtype {gdtype}")

    def step(self, updates: Sequence[tuple[int, C.AdamWHyperParams, Any, str]], *, eager: bool = False,
             max_blocks: int | None = None, grad_div: Mapping[int, float] | None = None) -> None:
        """Launch the update of each ``(slot, hyper-parameters, grad tensor, grad dtype)``; the gradients are contiguous
        device tensors of the parameter's size, already clipped and scaled by the framework. Returns once the kernels
        are queued on the update stream, after the compute stream's work so far. ``eager``: from a gradient hook
        (counted as eager updates, not a step). ``max_blocks``: grid cap of the kernels (eager default:
        :data:`EAGER_SM_FRACTION`). ``grad_div``: ``{slot: scale}`` of fused slots stepped with GradScaler's
        ``grad_scale`` (the kernel divides the gradient by it and writes the result back, as torch's fused kernel)."""
        self._check_open()
        be = self.backend
        t0 = time.perf_counter()
        self.check_grads(updates)
        for sid in grad_div or ():
            rec = self._slot(sid).recipe
            if rec is None or rec.impl != "fused":
                raise ValueError(f"grad_div: parameter slot {sid} ({rec!r}) is not fused: GradScaler unscales its "
                                 "gradient before the step")
        if eager:
            self._eager_updates += len(updates)
            if max_blocks is None:
                max_blocks = self._eager_grid
        else:
            self._steps += 1
        be.update_wait(be.record_compute(None))  # what produced the gradients precedes the update
        self._unwaited = True
        self._launch_grouped(updates, be.update_stream(), max_blocks, grad_div or {})
        self._launch_s += time.perf_counter() - t0

    def _kernel_key(self, s: GpuSlot, gdtype: str) -> tuple:
        """Slots of one key share a launch: the kernel (and amsgrad: whether items carry max_exp_avg_sq)."""
        if s.recipe is None:
            return (self.convention, s.dtype, gdtype)
        return (R.recipe_kernel_name(s.recipe, gdtype), bool(s.recipe.amsgrad))

    def _launch_grouped(self, updates, stream: int, max_blocks: int | None = None, grad_div=None) -> None:
        """Launch consecutive updates of one kernel together, up to ``MULTI_MAX`` tensors and
        :data:`MULTI_LAUNCH_ELEMS` elements (with ``max_blocks`` one tensor per launch), one ready event per launch.
        A slot listed twice goes into the next launch."""
        cap = self._dk.MULTI_MAX if max_blocks is None else 1
        group: list[tuple[GpuSlot, Any, Any, str]] = []
        key, elems = None, 0
        for sid, hp, grad, gdtype in updates:
            s = self._slot(sid)
            k = self._kernel_key(s, gdtype)
            if group and (k != key or len(group) == cap or elems + s.numel > MULTI_LAUNCH_ELEMS
                          or any(x[0] is s for x in group)):
                self._launch_group(group, stream, max_blocks, grad_div or {})
                group, elems = [], 0
            group.append((s, hp, grad, gdtype))
            key, elems = k, elems + s.numel
        if group:
            self._launch_group(group, stream, max_blocks, grad_div or {})

    def _item(self, s: GpuSlot, hp, grad, gd: str, grad_div):
        """``(arrays, item)`` of one slot's update: its state buffers (in the ring's order) and ``item(lo, n, ptrs)``,
        the kernel item of elements ``lo:lo+n`` with the state at ``ptrs`` (one per buffer)."""
        be = self.backend
        pp, gp = be.data_ptr(s.param), be.data_ptr(grad)
        pi, gi = _ITEMSIZE[s.dtype], _ITEMSIZE[gd]
        bufs = list(s.bufs().values())
        if s.recipe is None:  # the conventions' kernels: (param, grad, master, m, v, n, scalars)
            sc = C.step_scalars(hp, s.step + 1, self.convention, "cuda")
            half = s.master is not None
            return bufs, lambda lo, n, d: (pp + pi * lo, gp + gi * lo, d[2] if half else 0, d[0], d[1], n, sc)
        rec = s.recipe
        scale = grad_div.get(s.id)
        sc = R.cuda_scalars(rec, hp, s.step + 1, grad_div=1.0 if scale is None else float(scale))
        torch_vec = (s.numel % 4 == 0 if s.master is not None  # torch updates a master: a fresh fp32 tensor
                     else R.torch_vector_path(s.numel, pi, pp, gp))
        flags = R.recipe_flags(rec, hp, grad_scale=scale is not None, torch_vec=torch_vec)
        ams, mw = s.max_exp_avg_sq is not None, s.master is not None
        return bufs, lambda lo, n, d: R.TorchItem(pp + pi * lo, gp + gi * lo, d[-1] if mw else 0, d[0], d[1],
                                                  d[2] if ams else 0, n, sc, flags, lo)

    def _launch_group(self, group, stream: int, max_blocks: int | None, grad_div) -> None:
        """Launch ``group`` (its staged slots through the ring) and record its ready event."""
        be = self.backend
        s0, gd = group[0][0], group[0][3]
        ring = self._staging_ring() if any(s.exp_avg.host is not None for s, *_ in group) else None
        direct, entries, staged = [], [], []
        for s, hp, grad, _ in group:
            bufs, item = self._item(s, hp, grad, gd, grad_div)
            if ring is None or s.exp_avg.host is None:
                direct.append(item(0, s.numel, [b.dev_ptr for b in bufs]))
                continue
            staged.append(s)
            entries.append(([(b.host_ptr, b.itemsize) for b in bufs], s.numel, item, s.copied_back))

        if s0.recipe is None:
            variant = C.variant_id(self.convention, "cuda")

            def launch(batch):
                self._dk.launch_adamw_multi(variant, s0.dtype, gd, batch, stream=stream, device=self.device,
                                            max_blocks=max_blocks)
        else:
            def launch(batch):
                R.launch_torch_multi(s0.recipe, gd, batch, stream=stream, device=self.device, max_blocks=max_blocks)

        if direct:
            launch(direct)
        if staged:
            for s, ev in zip(staged, ring.run(launch, entries, stream)):
                s.copied_back = ev or s.copied_back
        ready = be.record_update()
        for s, _, grad, _ in group:  # counted once the launch is queued
            s.step += 1
            s.grad_keep = grad  # alive until the compute stream has waited on `ready`
            s.ready = ready

    def _staging_ring(self) -> StagingRing | None:
        if self._ring is None and self.staged:
            with self._ring_lock:
                if self._ring is None and self.staged:
                    self._ring = staging_ring(self.device, self._dk, "gpu mode")
                    self.staged = self._ring is not None
        return self._ring

    def launch_external(self, items: Sequence[DeviceUpdate], stream: int) -> None:
        """The AdamW update of each :class:`~trainstream.core._external.DeviceUpdate` in this placement's convention
        on CUDA, queued on ``stream`` (the caller's, e.g. XLA's) after its work so far; returns once queued. The
        items of one kind (:func:`~trainstream.core._external.device_groups`) go in launches of up to ``MULTI_MAX``,
        their state through the staging ring (its copies in after ``stream``'s work so far, ``stream`` then waiting
        for its copies back), or zero-copy without one. No slot is involved: the caller keeps every buffer alive
        until ``stream`` has run the launches."""
        self._check_open()
        t0 = time.perf_counter()
        groups = device_groups(items)  # checked before anything is queued
        dk, variant = self._dk, C.variant_id(self.convention, "cuda")
        ring = self._staging_ring()
        after = _cuda.Event(ring.ctx, stream) if ring is not None else None  # the caller's work: the state's writers
        for key, entries in groups.items():
            kind, dtype, gdtype, state = key
            if kind == "u":
                launch = functools.partial(dk.launch_adamw_u_multi, variant, gdtype, stream=stream, device=self.device,
                                           **({"param_dtype": dtype, "state": state} if state else {}))
            else:
                launch = functools.partial(dk.launch_adamw_multi, variant, dtype, gdtype, stream=stream,
                                           device=self.device, **({"state": state} if state else {}))
            if ring is not None:
                ring.run(launch, entries, stream, after)
                after = None
            else:
                for k in range(0, len(entries), dk.MULTI_MAX):
                    launch([item(0, n, [a for a, _ in state]) for state, n, item, _ in entries[k:k + dk.MULTI_MAX]])
        if ring is not None and ring.last is not None:
            ring.ctx.stream_wait_event(stream, ring.last)  # the caller's later readers see the state copied back
        self._steps += 1
        self._launch_s += time.perf_counter() - t0

    def wait_ready(self, sids: Sequence[int]) -> None:
        t0 = time.perf_counter()
        waited = None  # the slots of one multi-tensor launch share its event: one wait
        for sid in sids:
            s = self._slot(sid)
            if s.ready is not None and s.ready is not waited:
                self.backend.wait_on_compute(s.ready, s.param)
                waited = s.ready
            s.grad_keep = None  # the compute stream now runs after the kernel that reads it
        self._ready_stall_s += time.perf_counter() - t0

    def wait_all(self) -> None:
        """Make the compute stream wait for every update launched so far (no host block)."""
        if self._unwaited:
            self._unwaited = False
            self.backend.wait_on_compute(self.backend.record_update(), None)
            for s in self._slots:  # the compute stream now runs after their kernels
                s.grad_keep = None

    def reload_param(self, sid: int, param: Any = None) -> None:
        """As :meth:`trainstream.core._host.HostPlacement.reload_param` (fp16/bf16 masters only)."""
        s = self._slot(sid)
        s.settle()
        if param is not None:
            s.param = param
        if s.master is not None:
            weights = np.empty(s.numel, np.float32)
            self.backend.param_to_host_f32(s.param, weights)
            stream = self.backend.update_stream()
            master = read_buf(s.master, s.numel, stream, copy=False)
            C.merge_master(master, weights, s.dtype)
            if s.master.host is None:
                write_buf(s.master, master, stream)

    def drain(self) -> None:
        for s in self._slots:
            s.settle()
            s.grad_keep = None

    def recipe(self, sid: int):
        """The slot's recipe (None: the optax convention's kernels)."""
        return self._slot(sid).recipe

    def supports(self, recipe) -> bool:
        """Whether these kernels run ``recipe`` (:func:`trainstream._device_recipes.check_recipe`; torch convention)."""
        if self.convention != "torch":
            return False
        try:
            R.check_recipe(recipe)
        except NotImplementedError:
            return False
        return True

    def set_recipe(self, sid: int, recipe) -> None:
        """Slot ``sid``'s next updates follow ``recipe``, of the slot's state layout (the engine checked it)."""
        self._check_open()
        s = self._slot(sid)
        R.check_recipe(recipe)
        if s.recipe is None or (s.recipe.dtype, R.state_dtype(s.recipe), s.recipe.amsgrad) != \
                (recipe.dtype, R.state_dtype(recipe), recipe.amsgrad):
            raise ValueError(f"set_recipe: device slot {sid} is laid out for {s.recipe}, not for {recipe}")
        s.recipe = recipe  # (launches already queued keep the kernel and scalars they were given)

    def state(self, sid: int, copy: bool = True) -> dict:
        """The slot's state once its queued work has run: ``step`` (int), ``exp_avg``, ``exp_avg_sq``, with amsgrad
        ``max_exp_avg_sq`` (flat arrays of the state dtype: float32, or the uint16 bits of fp16/bf16), with a master
        ``master`` (float32). ``copy=False``: mapped state as views (GPU-resident state is copied anyway)."""
        s = self._slot(sid)
        s.settle()
        stream = self.backend.update_stream() if self.backend is not None else 0
        out = {k: read_buf(b, s.numel, stream, copy) for k, b in s.bufs().items()}
        return {"step": s.step, **out}

    def load_state(self, sid: int, state, *legacy) -> None:
        """Set the slot's state from a dict with :meth:`state`'s keys (``master`` optional: without it, a slot with a
        master takes the weights'); arrays of the state dtype (uint16 bits for fp16/bf16, or values of the dtype).
        Every key and size is checked before anything is written. (The positional form ``(exp_avg, exp_avg_sq,
        step, master=None)`` of the fp32 scheme is accepted too.)"""
        s = self._slot(sid)
        if not isinstance(state, Mapping):  # (exp_avg, exp_avg_sq, step, master=None)
            names = ("exp_avg", "exp_avg_sq", "step", "master")
            state = dict(zip(names, (state, *legacy)))
        step = check_state(s, state)
        s.settle()
        stream = self.backend.update_stream()
        for k, buf in s.bufs().items():
            if k == "master":
                master = state.get("master")
                if master is None:
                    master = np.empty(s.numel, np.float32)
                    self.backend.param_to_host_f32(s.param, master)
                write_buf(buf, np.asarray(master, np.float32).reshape(-1), stream)
            else:
                write_buf(buf, to_storage(state[k], buf.dtype), stream)
        s.step = step

    def stats(self) -> dict[str, float]:
        """:meth:`trainstream.core._engine.Engine.stats`; ``host_state_bytes``: the mapped state;
        ``staging_ring_bytes`` is 0 before the first update."""
        live = [s for s in self._slots if s.exp_avg is not None]  # not released
        resident = [s for s in live if s.exp_avg.mem is not None]
        bufs = [b for s in live for b in s.bufs().values()]
        mapped = float(sum(b.nbytes for b in bufs if b.mem is None))
        return {
            "params": float(len(live)), "numel": float(sum(s.numel for s in live)),
            "threads": 0.0, "gpu_mode": 1.0, "steps": float(self._steps),
            "eager_updates": float(self._eager_updates), "host_state_bytes": mapped,
            "pinned_state_bytes": mapped, "pageable_state_bytes": 0.0,
            "gpu_state_bytes": float(sum(b.nbytes for b in bufs if b.mem is not None)),
            "staging_ring_bytes": float(self._ring.nbytes if self._ring is not None else 0),
            "gpu_state_params": float(len(resident)), "gpu_state_numel": float(sum(s.numel for s in resident)),
            "grad_bytes_offloaded": 0.0, "param_bytes_uploaded": 0.0,
            "update_ms_total": self._launch_s * 1e3,  # host launch time; device time is async
            "ready_stall_ms_total": self._ready_stall_s * 1e3, "grad_stall_ms_total": 0.0,
            "last_step_wall_ms": 0.0,
        }

    def close(self) -> None:
        if self.closed:
            return
        try:
            self.drain()
        finally:
            self.closed = True
            ring, self._ring = self._ring, None
            try:
                if ring is not None:
                    ring.close()
            finally:
                self.truncate(0)
