"""The host placement: slots updated on worker threads by Numba kernels (:mod:`trainstream._host_kernels`,
the contract's arithmetic), and updates over buffers the caller owns (:meth:`HostPlacement.update_external`,
no slot: the JAX adapter's). No torch or jax import: a :class:`Backend` supplies pinned buffers,
asynchronous copies, events and the compute stream (none for external updates only). Per parameter ("slot"):

1. ``offload_grad`` copies the gradient asynchronously into the slot's pinned staging, replacing what
   was staged (the framework sums micro-batches), or with ``accumulate`` adding it into the fp32 sum of a
   master (TrainStream 0.1.1's fp32 micro-batch sums); on the *eager* path the update is queued behind it,
   *speculative* where the adapter says so (committed or rolled back exactly: :mod:`~trainstream.core._speculate`).
2. ``step`` queues each slot's update (its staged gradient, or the sum, times the adapter's ``coefs``), in the
   arithmetic and state layout of the slot's recipe (:mod:`trainstream.core._hostslot`).
3. An update batch runs over the slot's chunks; its last chunk uploads the new weights (the fp32 master,
   or the rounded fp16/bf16 staging) and records the slot's *ready* event. With the backend's
   ``weights_in_grad_stage`` they overwrite the gradient's staging, each element after it is read (the
   next gradient copy waits for the upload): a pinned buffer and ~6 % of the update's memory traffic less.
4. :meth:`HostPlacement.wait_step` makes the compute stream wait for an event after every upload, once
   the workers have queued them all: the device never waits for work the host has not queued yet (that
   deadlocked the H200 at a lazily loaded kernel's first launch). ``wait_ready`` gates single slots.

A slot's batches run one after another; their chunks go to one queue shared by all workers
(:class:`~trainstream.core._pool.WorkerPool`). A worker's failure is raised at the next call; no waiter hangs.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import numpy as np

from .. import _host_kernels as K
from .._cores import default_threads
from .. import contract as C
from ._backend import Backend, HostBuffer
from ._budget import _ITEMSIZE
from ._external import KIND as _KIND, CHUNK_ALIGN, ExternalUpdate, HostExternal
from ._hostslot import HostSlot as _Slot, DevicePowers, SlotStateIO, check_host_recipe, new_slot
from ._pool import FORKED, WORKER_NICE, Counters, StickyError, WorkerError, WorkerPool
from ._speculate import SPEC_STATS, Speculation, Speculative
from ._stream import Streaming

__all__ = ["Backend", "CHUNK_SIZE", "ExternalUpdate", "HostPlacement", "HostBuffer", "StickyError", "WorkerError",
           "CHUNK_ALIGN"]

#: Elements per worker job, the default of ``chunk_size`` (read when a placement is made). Not an adapter
#: argument: nobody tunes it and no bit depends on it; tests set it to run small tensors in several chunks.
CHUNK_SIZE = 1 << 20

#: A speculative update's last chunk uploads nothing (its weights wait for ``commit``).
_NO_UPLOAD = object()

#: The host placement's counters (:class:`~trainstream.core._pool.Counters`).
_STATS = ("steps", "eager_updates", "grad_bytes", "param_bytes", "update_s", "ready_stall_s", "grad_stall_s",
          *SPEC_STATS)


class HostPlacement(Speculative, Streaming, HostExternal, SlotStateIO):
    """The slots updated on the host: their state, staging buffers and the worker pool. ``backend`` None: no
    slots, only :meth:`update_external` (buffers the caller owns).

    Args (the engine's): ``threads``: workers (default: the usable cores, or ``cores``, but one; at least
    1); ``cores``: CPU ids to bind them to (None: unbound; Linux); ``chunk_size``: elements per chunk
    (rounded up to a multiple of :data:`CHUNK_ALIGN`; None: :data:`CHUNK_SIZE`); ``convention``: ``"torch"`` or
    ``"optax"``; ``pin_moments``: ``exp_avg``/``exp_avg_sq`` page-locked (pageable by default: only host threads read
    them); ``tc_code``: the contract's torch/cpu code (``msqrt``'s mode | ``TC_NO_FMA``, probed by the
    adapter); ``worker_nice``: the workers' nice value (Linux, per thread): 5 yields the CPU to the threads
    that launch GPU kernels; 19 is faster for ``mode="hybrid"`` with ``last_micro_batch()`` (H200, 350M GPT:
    103-120 against 161 ms per step), else no different, and starves the workers beside a busy data loader.
    """

    def __init__(self, backend: Backend | None, *, threads: int | None = None, chunk_size: int | None = None,
                 convention: str = "torch", pin_moments: bool = False, tc_code: int = 0,
                 worker_nice: int = WORKER_NICE, errors: StickyError | None = None,
                 cores: Sequence[int] | None = None):
        if convention not in C.CONVENTIONS:
            raise ValueError(f"Unknown convention {convention!r}; expected one of {C.CONVENTIONS}")
        if threads is None:  # every core but one, which drives the framework
            threads = default_threads(1, list(cores) if cores else None)
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be a positive integer, got {threads!r}")
        if chunk_size is None:
            chunk_size = CHUNK_SIZE
        if not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
        if isinstance(worker_nice, bool) or not isinstance(worker_nice, int):
            raise ValueError(f"worker_nice must be an integer nice value, got {worker_nice!r}")
        self.backend, self.convention, self.pin_moments, self.tc_code = backend, convention, pin_moments, int(tc_code)
        self.chunk = -(-chunk_size // CHUNK_ALIGN) * CHUNK_ALIGN
        self._slots: list[_Slot] = []
        self.errors = errors if errors is not None else StickyError()
        self._stats = Counters(_STATS)
        self._weights_in_grad_stage = bool(getattr(backend, "weights_in_grad_stage", False))
        self.threads = threads
        self.closed = False
        self._unwaited = False  # updates queued since the last wait_step
        self._powers = DevicePowers(backend)
        self._pool = WorkerPool(self, threads, worker_nice, cores)

    def _check_open(self) -> None:
        if self._pool.forked:
            raise RuntimeError(FORKED)
        if self.closed:
            raise RuntimeError("TrainStream engine is closed")

    def _slot(self, sid: int) -> _Slot:
        if not isinstance(sid, (int, np.integer)) or not 0 <= sid < len(self._slots):
            raise IndexError(f"TrainStream engine: no parameter slot {sid!r}")
        return self._slots[sid]

    def _alloc(self, numel: int, dtype: str, pinned: bool, what: str, tally: list[int]) -> HostBuffer:
        """A backend buffer; adds its bytes to ``tally`` (``[pinned, pageable]``)."""
        buf = self.backend.host_empty(numel, dtype, pinned=pinned, what=what)
        tally[0 if buf.pinned else 1] += numel * _ITEMSIZE[dtype]
        return buf

    def add_param(self, param: Any, numel: int, dtype: str, platform: str, recipe: C.TorchRecipe | None = None,
                  grad_sums: bool = False, streamed: bool = False) -> int:
        """Register a flat parameter; returns its slot id. Its buffers follow ``recipe`` (the torch convention; None:
        :func:`~trainstream.contract.default_recipe`, the fp32-master scheme) with ``grad_sums`` (a master's fp32
        gradient sums, for ``offload_grad(accumulate=True)``); the weights are read into them. ``streamed``: bounded
        staging (:mod:`~trainstream.core._stream`: updated by ``stream_update`` or ``step`` with its gradient)."""
        self._check_open()
        if self.backend is None:
            raise RuntimeError("TrainStream engine: this engine has no framework backend; it updates buffers the "
                               "caller owns (update_external), it holds no parameters")
        if dtype not in _KIND:
            raise TypeError(f"TrainStream supports float32, float16 and bfloat16 parameters, got {dtype}")
        if platform not in C.PLATFORMS:
            raise ValueError(f"Unknown platform {platform!r}; expected one of {C.PLATFORMS}")
        if self.convention == "optax":
            if recipe is not None:
                raise ValueError("add_param: a TorchRecipe needs the torch convention")
        else:
            recipe = C.check_recipe(recipe if recipe is not None else C.default_recipe(platform, dtype))
            if (recipe.platform, recipe.dtype) != (platform, dtype):
                raise ValueError(f"add_param: the recipe is for {recipe.dtype} parameters on {recipe.platform}, the "
                                 f"parameter is {dtype} on {platform}")
        if streamed:
            self._stream_ring()  # (its bytes counted in stats as stream_ring_bytes)
        s = new_slot(len(self._slots), param, int(numel), dtype, platform, recipe, grad_sums, self._alloc,
                     self.pin_moments, self._weights_in_grad_stage, self.backend, streamed)
        self._slots.append(s)
        return s.id

    def truncate(self, n: int) -> None:
        """Drop the slots registered after the first ``n`` (a failed registration)."""
        for s in self._slots[n:]:
            self._wait_idle(s)
        del self._slots[n:]

    def release(self, sid: int) -> None:
        """Free slot ``sid``'s buffers once its queued work has run; the id stays taken, by an empty slot."""
        self._check_open()
        s = self._slot(sid)
        self._halt_precopy(s)
        self._settle(s)
        s.free()

    def get_step(self, sid: int) -> int:
        """Slot ``sid``'s step count (before a speculative update still pending: what the framework shows)."""
        s = self._slot(sid)
        return s.step if s.spec is None else s.spec.step

    def has_grad(self, sid: int) -> bool:
        return self._slot(sid).staged

    def _submit(self, numel: int, priority: float, landed: Any, body: Callable[[int, int, int], None],
                finalize: Callable[[], None] | None, record: Callable[[BaseException], None],
                done: Callable[[], None]) -> None:
        """Queue one batch of this placement's chunks (:meth:`~trainstream.core._pool.WorkerPool.submit`)."""
        self._pool.submit(numel, self.chunk, priority, landed, body, finalize, record, done)

    def _run_batch(self, s: _Slot, body: Callable[[int, int, int], None],
                   finalize: Callable[[], None] | None = None, landed: Any = None, numel: int | None = None) -> None:
        """Queue a batch of slot ``s`` (:meth:`_submit`; errors sticky) over its elements (or ``numel``), after its
        batch in flight if any."""
        with s.cond:
            s.inflight += 1
            if s.inflight > 1:  # a batch of this slot is queued or running: run after it
                s.chain.append((body, finalize, landed, numel))
                return
        try:
            self._submit_batch(s, body, finalize, landed, numel)
        except BaseException:
            with s.cond:  # never queued: waiters must not wait for it
                s.inflight -= 1
                s.cond.notify_all()
            raise

    def _submit_batch(self, s: _Slot, body, finalize, landed, numel=None) -> None:
        def done() -> None:  # then submit the slot's next chained batch, if any
            with s.cond:
                s.grad_keep = None  # its copy has landed (or failed)
                s.inflight -= 1
                nxt = s.chain.popleft() if s.chain else None
                pre = self._due_precopy(s)
                s.cond.notify_all()
            if pre is not None:  # the slot's queued work has run: copies taken ahead read what it wrote
                self._queue_precopy(s, pre)
            if nxt is None:
                return
            try:
                self._submit_batch(s, *nxt)
            except BaseException as exc:  # noqa: BLE001 - kept and raised at the next call
                self.errors.record(exc)
                with s.cond:  # it and the batches chained after it leave ``inflight``
                    s.inflight -= 1 + len(s.chain)
                    s.chain.clear()
                    s.cond.notify_all()

        self._submit(s.numel if numel is None else numel, s.id, landed, body, finalize, self.errors.record, done)

    def _wait_idle(self, s: _Slot) -> None:
        if self._pool.forked:  # before the lock: a worker of the parent may have held it
            raise RuntimeError(FORKED)
        with s.cond:
            while s.inflight:
                s.cond.wait()

    def _settle(self, s: _Slot) -> None:
        """Wait for the slot's batches and its last upload."""
        self._wait_idle(s)
        if s.ready is not None:
            s.ready.synchronize()

    def offload_grad(self, sid: int, grad: Any, grad_dtype: str, update: C.AdamWHyperParams | None = None,
                     accumulate: bool = False, speculate: bool = False, upload: bool = True, coef: float = 1.0,
                     grad_div: float | None = None) -> None:
        """Stage the gradient of slot ``sid`` (a device tensor of ``grad_dtype``), replacing the one staged before,
        or with ``accumulate`` adding it into the slot's fp32 sum (a master with ``grad_sums``; the first since the
        last update starts the sum); with ``update`` (the eager path) queue its update right behind it, with
        ``speculate`` as a speculative one (:mod:`~trainstream.core._speculate`; ``upload``: its weights uploaded at
        once, else at ``commit``; ``coef``, ``grad_div``: as :meth:`step`'s, assumed). A speculation still pending on
        the slot is rolled back first."""
        self._check_open()
        self.errors.check()
        s = self._slot(sid)
        self._check_grad(sid, None, grad_dtype, staged=True)
        if (coef != 1.0 or grad_div is not None) and not speculate:
            raise ValueError("offload_grad: coef and grad_div are a speculative update's assumptions (speculate=True)")
        if grad_div is not None and (s.recipe is None or s.recipe.impl != "fused"):
            raise ValueError(f"offload_grad: grad_div for parameter slot {sid}, whose recipe is not fused")
        if speculate and (update is None or accumulate or not s.speculable):
            raise ValueError(f"offload_grad: parameter slot {sid} cannot take a speculative update (it needs update=, "
                             "no accumulate, and a slot whose gradient staging the update only reads: no fp16/bf16 "
                             "master)")
        self._unspeculate(s)
        if update is not None:
            check_host_recipe(s.recipe, update, grad_div)
        if accumulate and s.grad_sum is None:
            raise ValueError(f"offload_grad(accumulate=True): parameter slot {sid} keeps no fp32 gradient sum (a "
                             "master of fp16/bf16 weights registered with grad_sums)")
        t0 = time.perf_counter()
        self._wait_idle(s)  # the previous batch may still read the staging buffer
        self._stats.add("grad_stall_s", time.perf_counter() - t0)
        self.errors.check()
        after = self.backend.record_compute(s.param)
        # The last upload may still read the staging buffer (weights in grad staging).
        free = {"free": s.ready} if s.param_stage is s.grad_stage and s.ready is not None else {}
        s.landed = self.backend.copy_to_host(s.grad_stage, grad, after, **free)
        # Keep the device gradient alive until its copy ran, unless the backend does (torch: record_stream).
        s.grad_keep = None if getattr(self.backend, "copy_keeps_source_alive", False) else grad
        self._stats.add("grad_bytes", s.numel * _ITEMSIZE[s.dtype])
        s.staged = True
        if accumulate and (s.summed or update is None):  # into the fp32 sum (an eager first one updates from staging)
            fresh, landed, acc, stage, gkind = not s.summed, s.landed, s.grad_sum.array, s.grad_stage.array, _KIND[s.dtype]

            def body(c: int, b: int, e: int) -> None:
                if landed is not None:
                    landed.synchronize()
                K.accumulate_chunk(acc, stage, gkind, b, e, fresh)

            s.summed = True
            self._run_batch(s, body, None, landed)
        elif not accumulate:
            s.summed = False
        if update is not None:  # eager: the update follows the copy in each chunk's order
            self._stats.add("eager_updates", 1)
            self._enqueue_update(s, update, np.float32(coef), after, grad_div, speculate=speculate, upload=upload)

    def discard_grads(self) -> None:
        """Forget gradients offloaded since the last step (``zero_grad``)."""
        self._check_open()
        # zero_grad before step(): torch's step updates nothing from these gradients
        self._settle_uploads([s for s in self._slots if self._unspeculate(s)])
        for s in self._slots:
            if s.staged:
                self._wait_idle(s)
                s.staged, s.summed, s.grad_keep = False, False, None
        self.errors.check()

    def _update_args(self, s: _Slot, hp: C.AdamWHyperParams, clip: np.float32, grad_div: float | None
                     ) -> tuple[int, np.ndarray, tuple]:
        """``(variant, scalars, extra)`` of slot ``s``'s update at step ``s.step`` (``extra``: the kernel's
        ``(recipe, vmax, tails)``, none for the optax convention)."""
        recipe, extra = s.recipe, ()
        if recipe is None:  # the optax convention
            scalars = C.step_scalars(hp, s.step, self.convention, s.platform, clip)
        else:
            bias = self._powers.bias(recipe, s.step, hp)
            scalars = C.torch_scalars(recipe, hp, s.step, clip, grad_scale=grad_div, bias=bias)
            # fp16/bf16 Adam-L2 on the CPU: the tails follow torch.get_num_threads() now (the backend's cpu_threads)
            threads = int(getattr(self.backend, "cpu_threads", int)() or 1) if C.tails_follow_threads(
                recipe, self.tc_code) else 1
            extra = (recipe, None if s.max_exp_avg_sq is None else s.max_exp_avg_sq.array,
                     C.torch_cpu_tails(recipe, s.numel, self.tc_code, threads))  # recipe, vmax, tails
        return C.variant_id(self.convention, s.platform), scalars, extra

    def _enqueue_update(self, s: _Slot, hp: C.AdamWHyperParams, clip: np.float32, after: Any,
                        grad_div: float | None = None, speculate: bool = False, upload: bool = True) -> None:
        spec = Speculation(s.step, upload) if speculate else None
        keep = s.backed_up() if speculate else ()
        pre = self._take_precopy(s) if speculate else self._halt_precopy(s)  # what was copied ahead: not again
        s.step += 1
        variant, scalars, extra = self._update_args(s, hp, clip, grad_div)
        m, v = s.exp_avg.array, s.exp_avg_sq.array
        g, gkind = (s.grad_sum.array, K.KIND_F32) if s.summed else (s.grad_stage.array, _KIND[s.dtype])
        p = None if s.master is None else s.master.array
        out = s.weights if s.weights is not None else s.param_stage
        out, okind = (None, 0) if out is None else (out.array, _KIND[s.dtype])
        upload_src = s.upload_src
        landed, prev_ready, nbytes, tc_code = s.landed, s.ready, s.numel * _ITEMSIZE[s.dtype], self.tc_code

        def body(c: int, b: int, e: int) -> None:
            if prev_ready is not None:  # the previous upload may still read master/stage
                prev_ready.synchronize()
            if landed is not None:  # the gradient copy must have landed in staging
                landed.synchronize()
            t = time.perf_counter()
            if keep and self._precopied(s, pre, c):
                keep_s = 0.0
            else:
                for live, copy in keep:  # the chunk's pre-step copies (NumPy copies this large without the GIL)
                    copy[b:e] = live[b:e]
                keep_s = time.perf_counter() - t
                self._stats.add("backup_s", keep_s)
            K.adamw_chunk(variant, p, m, v, g, gkind, out, okind, b, e, scalars, tc_code, *extra)
            dt = time.perf_counter() - t
            self._stats.add("update_s", dt - keep_s)
            if spec is not None:
                spec.seconds.append(dt)

        # Not after a failure: a failed chunk's staging range is unwritten, so the old weights stay.
        def finalize() -> None:
            upload_after = after
            if spec is not None:
                with s.cond:  # commit() reads done there: the weights of a committed update are uploaded once
                    spec.done = True
                    if not spec.upload and spec.committed:
                        upload_after = spec.after
                    elif not spec.upload:
                        upload_after = _NO_UPLOAD
            if upload_after is not _NO_UPLOAD:
                s.ready = self.backend.copy_to_device(s.param, upload_src, upload_after)
                self._stats.add("param_bytes", nbytes)
            self._stats.last_finalize = time.perf_counter()

        s.spec = spec
        if spec is not None:
            self._stats.add("spec_updates", 1)
            self._stats.add("spec_uploads_early", int(upload))
        s.staged = s.summed = False
        self._unwaited = True
        self._run_batch(s, body, finalize, landed)

    def wait_step(self) -> None:
        """Make the compute stream wait for every update queued so far (module docstring, 4.);
        raises nothing (a failure is raised at the next call)."""
        if not self._unwaited:
            return
        self._unwaited = False
        t0 = time.perf_counter()
        for s in self._slots:
            self._wait_idle(s)
        record = getattr(self.backend, "record_uploads", None)
        if record is not None:
            self.backend.wait_on_compute(record(), None)
        else:
            for s in self._slots:
                if s.ready is not None:
                    self.backend.wait_on_compute(s.ready, s.param)
        self._stats.add("ready_stall_s", time.perf_counter() - t0)

    def step(self, updates: Sequence[tuple[int, C.AdamWHyperParams]], coefs: dict[int, float] | None = None,
             check_errors: bool = True, grad_div: dict[int, float] | None = None) -> None:
        """Queue the update of every slot in ``updates`` that holds a gradient (an eagerly updated
        slot holds none): ``(sid, hp)``, or for a streamed slot ``(sid, hp, grad, grad dtype)`` (its gradient on the
        device: :meth:`stream_update`). ``coefs``: per slot, the contract's ``c`` multiplying its staged gradient
        (1.0 where absent); ``grad_div``: per slot of a fused recipe, GradScaler's scale its gradient is divided by
        (``S_GRAD_DIV``). ``check_errors=False``: an error since the caller's check raises at the next call."""
        self._check_open()
        if check_errors:
            self.errors.check()
        coefs, grad_div = coefs or {}, grad_div or {}
        for sid, scale in grad_div.items():
            r = self._slot(sid).recipe
            if r is None or r.impl != "fused":
                raise ValueError(f"step: grad_div for parameter slot {sid}, whose recipe is not fused (torch's other "
                                 "implementations unscale by a multiplier: coefs)")
        for sid, hp, *grad in updates:  # before anything is queued: a refusal leaves every slot as it was
            check_host_recipe(self._slot(sid).recipe, hp, grad_div.get(sid))
            self._check_grad(sid, *grad)
        self._stats.add("steps", 1)
        self._stats.step_start = time.perf_counter()
        for sid, hp, *grad in updates:
            s = self._slot(sid)
            if s.streamed and grad:
                self.stream_update(sid, hp, grad[0], grad[1], grad_div.get(sid))
            elif s.staged:
                self._enqueue_update(s, hp, np.float32(coefs.get(sid, 1.0)), self.backend.record_compute(s.param),
                                     grad_div.get(sid))

    def wait_ready(self, sids: Sequence[int]) -> None:
        """Make the compute stream wait until the new weights of ``sids`` are in place."""
        self.errors.check()
        t0 = time.perf_counter()
        for sid in sids:
            s = self._slot(sid)
            self._wait_idle(s)
            if s.ready is not None:
                self.backend.wait_on_compute(s.ready, s.param)
        self._stats.add("ready_stall_s", time.perf_counter() - t0)
        self.errors.check()

    def drain(self) -> None:
        """Block until every queued batch and upload has completed (raises nothing)."""
        for s in self._slots:
            self._settle(s)

    def synchronize(self) -> None:
        """Block until every queued batch and upload has completed; raise worker errors."""
        self.drain()
        self.errors.check()

    def stats(self) -> dict[str, float]:
        """Counters of the reference engine (bytes, milliseconds, counts)."""
        st = self._stats
        live = [s for s in self._slots if s.live]  # not released
        last_wall = st.last_finalize - st.step_start if st.last_finalize >= st.step_start else 0.0
        pinned, pageable = (sum(s.nbytes[k] for s in live) + r for k, r in zip((0, 1), self._ring_bytes()))
        return {
            "params": float(len(live)), "numel": float(sum(s.numel for s in live)),
            "threads": float(self.threads), "gpu_mode": 0.0, "steps": float(st.steps),
            "eager_updates": float(st.eager_updates), "host_state_bytes": float(pinned + pageable),
            "pinned_state_bytes": float(pinned), "pageable_state_bytes": float(pageable),
            "grad_bytes_offloaded": float(st.grad_bytes), "param_bytes_uploaded": float(st.param_bytes),
            "update_ms_total": st.update_s * 1e3, "ready_stall_ms_total": st.ready_stall_s * 1e3,
            "grad_stall_ms_total": st.grad_stall_s * 1e3, "last_step_wall_ms": last_wall * 1e3,
            **{k: float(getattr(st, k)) for k in SPEC_STATS if not k.endswith("_s")},
            **{f"{k[:-2]}_ms_total": getattr(st, k) * 1e3 for k in SPEC_STATS if k.endswith("_s")},
            "spec_backup_bytes": float(sum(s.backup_bytes() for s in live if s.backup is not None)),
            "stream_ring_bytes": float(sum(self._ring_bytes())),
            "streamed_params": float(sum(s.streamed for s in live)),
        }

    def close(self) -> None:
        """Drain the queued work, join the workers and release the host buffers."""
        if self.closed:
            return
        forked = self._pool.forked
        if not forked and self._pool.in_worker():
            # From a worker (e.g. a finalizer run by the garbage collector): let the workers drain and stop.
            self.closed = True
            self._pool.stop()
            return
        try:
            for s in self._slots if not forked else ():  # a child of os.fork() has no work to wait for
                self._wait_idle(s)
                if s.ready is not None:
                    try:
                        s.ready.synchronize()
                    except Exception:  # noqa: BLE001 - closing regardless
                        pass
        finally:
            self.closed = True
            self._pool.stop()  # joins the workers (once; a no-op in a child of os.fork())
            for s in self._slots:
                s.free()
            self._slots, self._ring = [], None
