"""The host placement: slots updated on worker threads by Numba kernels (:mod:`trainstream._host_kernels`,
the contract's arithmetic). No torch or jax import: a :class:`Backend` supplies pinned buffers,
asynchronous copies, events and the compute stream. Per parameter ("slot"):

1. ``offload_grad`` copies the gradient asynchronously into the slot's pinned staging, replacing what
   was staged (the framework sums micro-batches); on the *eager* path the update is queued behind it.
2. ``step`` queues each slot's update (its staged gradient times the adapter's ``coefs``).
3. An update batch runs over the slot's chunks; its last chunk uploads the new weights (the fp32 master,
   or the rounded fp16/bf16 staging) and records the slot's *ready* event. With the backend's
   ``weights_in_grad_stage`` they overwrite the gradient's staging, each element after it is read (the
   next gradient copy waits for the upload): a pinned buffer and ~6 % of the update's memory traffic less.
4. :meth:`HostPlacement.wait_step` makes the compute stream wait for an event after every upload, once
   the workers have queued them all: the device never waits for work the host has not queued yet (that
   deadlocked the H200 at a lazily loaded kernel's first launch). ``wait_ready`` gates single slots.

A slot's batches run one after another; their chunks go to one queue shared by all workers
(:class:`_WorkQueue`). A worker's failure is raised at the next call; no waiter hangs.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import os
import threading
import time
import traceback
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Protocol, Sequence

import numpy as np

from .. import _host_kernels as K
from .._cores import bind_current_thread, default_threads
from .. import contract as C
from ._budget import _ITEMSIZE

__all__ = ["Backend", "ExternalUpdate", "HostPlacement", "HostBuffer", "StickyError", "WorkerError", "NORM_BLOCK"]

#: Element block of the gradient-norm partials (chunk sizes are multiples of it).
NORM_BLOCK = 4096

_KIND = {"float32": K.KIND_F32, "float16": K.KIND_F16, "bfloat16": K.KIND_BF16}
_OUT_KIND = {"u": K.OUT_U, "float16": K.KIND_F16, "bfloat16": K.KIND_BF16}  # ExternalUpdate.out_kind


class WorkerError(RuntimeError):
    """A failure inside an engine worker thread, raised at the next call into the engine."""


class StickyError:
    """The engine's one error record: the first failure of a worker (or of a step that left one placement
    updated and the other not), raised at every later call until the state has been reloaded."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._text: str | None = None

    def record(self, exc: BaseException) -> None:
        text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        with self._lock:
            if self._text is None:
                self._text = text

    def check(self) -> None:
        """Raise :class:`WorkerError` if a failure is recorded."""
        msg = self._text  # an atomic read: only record() needs the lock
        if msg is not None:
            raise WorkerError(f"TrainStream optimizer worker failed: {msg}. The optimizer state of the parameters "
                              "updated in that step may be partly updated; reload a checkpoint (load_state_dict) to "
                              "continue from a consistent state.")

    def clear(self) -> None:
        self._text = None


class HostBuffer(Protocol):
    """A flat host buffer of a backend: ``array`` is a writable NumPy view (float32, or the uint16
    bits of fp16/bf16), ``handle`` the framework object for copies (e.g. a pinned torch tensor)."""

    array: np.ndarray
    handle: Any
    pinned: bool


class Event(Protocol):
    def synchronize(self) -> None: ...


class Backend(Protocol):
    """What the engine needs from a framework (``trainstream.backends.torch``, ``trainstream.jax``). Optional
    attributes: ``weights_in_grad_stage`` (module docstring, 3.) and ``copy_keeps_source_alive``."""

    def host_empty(self, numel: int, dtype: str, *, pinned: bool, what: str) -> HostBuffer:
        """A new host buffer; raises ``MemoryError`` naming ``what`` and the bytes."""

    def param_to_host_f32(self, param: Any, out: np.ndarray) -> None:
        """Copy the (flat) parameter into ``out`` (float32), synchronously."""

    def record_compute(self, param: Any) -> Event | None:
        """An event marking the current point of the compute stream of ``param``."""

    def copy_to_host(self, dst: HostBuffer, src: Any, after: Event | None, *,
                     free: Event | None = None) -> Event | None:
        """Start ``dst <- src`` (device tensor) after ``after``; return its completion event. ``free``
        (with ``weights_in_grad_stage``): an upload reading ``dst``, which the copy must follow. With
        ``copy_keeps_source_alive`` the backend keeps ``src`` alive until the copy completed."""

    def copy_to_device(self, dst: Any, src: HostBuffer, after: Event | None) -> Event | None:
        """Start ``dst (param) <- src`` after ``after``; return its completion event."""

    def wait_on_compute(self, event: Event | None, param: Any) -> None:
        """Make the compute stream of ``param`` wait for ``event`` (no host block)."""

    def record_uploads(self) -> Event | None:
        """Optional: an event after every weight upload queued so far (None: nothing to wait for);
        without it :meth:`HostPlacement.wait_step` waits for each slot's last upload event."""

    def pinned_size(self, nbytes: int) -> int:
        """Optional: the bytes a pinned ``host_empty`` buffer of ``nbytes`` takes (default ``nbytes``)."""


class ExternalUpdate(NamedTuple):
    """One tensor's AdamW update over flat NumPy views of buffers the caller owns (e.g. XLA's), run by
    :meth:`HostPlacement.update_external` with :func:`trainstream._host_kernels.adamw_chunk`."""

    p: np.ndarray  # float32 weights or fp32 master, updated in place (read-only with out_kind "u")
    m: np.ndarray  # float32 moments, in place
    v: np.ndarray
    g: np.ndarray  # the gradient: float32, or the uint16 bits of gdtype "float16"/"bfloat16"
    gdtype: str
    # None; the new weights rounded to out_kind "float16"/"bfloat16" (uint16 bits; may be g itself, each
    # element read before it is overwritten); or with out_kind "u" (optax) the float32 update u before the lr
    out: np.ndarray | None
    out_kind: str | None
    scalars: np.ndarray  # float32[N_SCALARS], read at the first chunk (the copy `landed` waits for may fill it)
    landed: Any = None  # None, or an event (synchronize(), optionally query()) to wait for before reading g, p, scalars
    finished: Callable[[], None] | None = None  # None, or called after the last chunk if none failed (e.g. upload out)


#: The workers' default nice value (see :class:`HostPlacement`'s ``worker_nice``).
WORKER_NICE = 5


class _WorkQueue:
    """Worker jobs in *forward order*: slot id (the order the next forward needs the parameters, while eager
    updates arrive in backward order), then submission order. Within a slot only the oldest job is eligible.
    A job whose gradient copy has not landed (``ready()`` False) is passed over for the lowest slot among the
    first :attr:`_SCAN` whose oldest job can run; if none can, the oldest job of all is taken (copies land in
    submission order). A get costs at most O(_SCAN) ``ready`` calls (cached per batch by :func:`_landed`;
    they must not raise); a stop (:meth:`close`) is handed out only once no job is left.
    """

    _SCAN = 16  # slots examined per pick

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._slots: dict[float, collections.deque] = {}  # priority -> its jobs, oldest first
        self._order: list[float] = []  # priorities with jobs, ascending
        self._all: collections.deque = collections.deque()  # every job entry, oldest first
        self._jobs = self._stops = 0
        self._closed = False
        self._seq = itertools.count()

    def close(self, workers: int) -> None:
        """Refuse new jobs; each of ``workers`` stops once no job is left."""
        with self._cond:
            self._closed = True
            self._stops += workers
            self._cond.notify_all()

    def put_many(self, jobs: Sequence[Callable[[], None]], priority: float = 0.0,
                 ready: Callable[[], bool] | None = None) -> None:
        """Queue one batch's ``jobs`` (one slot, one ``ready`` predicate). Raises once closed (a waiter,
        e.g. an XLA callback at interpreter exit, would hang)."""
        with self._cond:
            if self._closed:
                raise RuntimeError("TrainStream: the host workers have stopped (the engine was closed, or the "
                                   "interpreter is exiting); no update runs any more")
            q = self._slots.get(priority)
            if q is None:
                q = self._slots[priority] = collections.deque()
                bisect.insort(self._order, priority)
            for job in jobs:
                entry = [priority, next(self._seq), job, ready, False]  # last: taken
                q.append(entry)
                self._all.append(entry)
            self._jobs += len(jobs)
            self._cond.notify(len(jobs))

    def _take(self, entry: list) -> Callable[[], None]:
        entry[4] = True
        q = self._slots[entry[0]]
        q.popleft()  # always its slot's oldest: picked as a head, or as the oldest job of all
        if not q:
            del self._slots[entry[0]]
            self._order.pop(bisect.bisect_left(self._order, entry[0]))
        self._jobs -= 1
        while self._all and self._all[0][4]:  # drop the entries already taken
            self._all.popleft()
        return entry[2]

    def get(self) -> Callable[[], None] | None:
        with self._cond:
            while not self._jobs and not self._stops:
                self._cond.wait()
            if not self._jobs:
                self._stops -= 1
                return None
            for priority in self._order[: self._SCAN]:
                head = self._slots[priority][0]
                if head[3] is None or head[3]():
                    return self._take(head)
            return self._take(self._all[0])  # the oldest job left (taken ones are dropped)


def _landed(query: Callable[[], bool]) -> Callable[[], bool]:
    """A batch's ``ready()`` for its chunks: True once its event completed, or a query failed (the body raises)."""
    done = False

    def ready() -> bool:
        nonlocal done
        if not done:
            try:
                done = bool(query())
            except Exception:  # noqa: BLE001
                return True
        return done
    return ready


class _WorkerPool(_WorkQueue):
    """The one :class:`_WorkQueue` shared by ``threads`` workers, bound to ``cores`` (None: unbound) at
    nice value ``nice``. Holds nothing of the engine, whose finalizer stops the threads."""

    def __init__(self, threads: int, nice: int = WORKER_NICE, cores: Sequence[int] | None = None):
        super().__init__()
        self._nice = int(nice)
        self._cores = list(cores) if cores else None
        self._threads = [threading.Thread(target=self._run, name=f"trainstream-worker-{i}", daemon=True)
                         for i in range(threads)]
        for t in self._threads:
            t.start()

    def _run(self) -> None:
        try:  # Linux applies nice values per thread; elsewhere a no-op
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self._nice)
        except (AttributeError, OSError):
            pass
        bind_current_thread(self._cores)
        while True:
            job = self.get()
            if job is None:
                return
            job()

    def shutdown(self) -> None:
        self.close(len(self._threads))  # each worker stops after every queued job
        for t in self._threads:
            if t is not threading.current_thread():
                t.join()


#: The host placements of this process. In a child of ``os.fork()`` (no workers, maybe a lock a worker
#: held) they refuse work and close without waiting.
_LIVE: weakref.WeakSet = weakref.WeakSet()

_FORKED = ("TrainStream: this optimizer was built in the parent process before os.fork(); its "
           "worker threads do not exist in this child process. Build a new optimizer in the "
           "child (or fork before building it).")


def _orphan_after_fork() -> None:
    for h in list(_LIVE):
        h._forked = True
        h._finalizer.detach()  # its workers did not survive the fork: nothing to stop


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_orphan_after_fork)


@dataclass(eq=False)
class _Slot:
    id: int
    param: Any
    numel: int
    dtype: str
    platform: str
    master: HostBuffer
    exp_avg: HostBuffer
    exp_avg_sq: HostBuffer
    grad_stage: HostBuffer | None = None
    param_stage: HostBuffer | None = None  # fp16/bf16 weights to upload; may be grad_stage
    step: int = 0
    # The gradient staging, as the caller made it: whether that copy is still the gradient to update from is
    # the caller's to decide (the torch adapter's per-parameter record), never this slot's. ``staged``: an
    # offload_grad since the slot's last update or discard_grads (step() updates only such a slot).
    staged: bool = False
    landed: Any = None  # completion event of the last gradient copy
    grad_keep: Any = None  # the device gradient, alive until its copy completed
    ready: Any = None  # completion event of the last weight upload
    inflight: int = 0  # batches queued, running or chained
    chain: collections.deque = field(default_factory=collections.deque)  # batches waiting for the running one
    cond: threading.Condition = field(default_factory=threading.Condition)
    nbytes: tuple[int, int] = (0, 0)  # the pinned and pageable bytes of its buffers, as counted

    def free(self) -> None:
        self.nbytes, self.staged = (0, 0), False
        self.master = self.exp_avg = self.exp_avg_sq = None  # type: ignore[assignment]
        self.grad_stage = self.param_stage = self.grad_keep = self.ready = self.landed = self.param = None


class _Stats:
    """Counters without a lock (a contended lock makes a worker give up the GIL): each thread adds
    into its own dict, readers sum them."""

    _NAMES = ("steps", "eager_updates", "grad_bytes", "param_bytes", "update_s", "ready_stall_s", "grad_stall_s")

    def __init__(self) -> None:
        self._local = threading.local()
        self._all: list[dict] = []
        self.step_start = self.last_finalize = 0.0

    def add(self, name: str, value: float) -> None:
        d = getattr(self._local, "d", None)
        if d is None:
            d = self._local.d = dict.fromkeys(self._NAMES, 0)
            self._all.append(d)  # list.append is atomic
        d[name] += value

    def __getattr__(self, name: str):
        if name in _Stats._NAMES:
            return sum(d[name] for d in list(self._all))
        raise AttributeError(name)


class HostPlacement:
    """The slots updated on the host: their state, staging buffers and the worker pool.

    Args (the engine's): ``threads``: workers (default: the usable cores, or ``cores``, but one; at least
    1); ``cores``: CPU ids to bind them to (None: unbound; Linux); ``chunk_size``: elements per chunk
    (rounded up to a multiple of :data:`NORM_BLOCK`); ``convention``: ``"torch"`` or ``"optax"``;
    ``pin_moments``: ``exp_avg``/``exp_avg_sq`` page-locked (pageable by default: only host threads read
    them); ``tc_code``: the contract's torch/cpu code (``msqrt``'s mode | ``TC_NO_FMA``, probed by the
    adapter); ``worker_nice``: the workers' nice value (Linux, per thread): 5 yields the CPU to the threads
    that launch GPU kernels; 19 is faster for ``mode="hybrid"`` with ``last_micro_batch()`` (H200, 350M GPT:
    103-120 against 161 ms per step), else no different, and starves the workers beside a busy data loader.
    """

    def __init__(self, backend: Backend, *, threads: int | None = None, chunk_size: int = 1 << 20,
                 convention: str = "torch", pin_moments: bool = False, tc_code: int = 0,
                 worker_nice: int = WORKER_NICE, errors: StickyError | None = None,
                 cores: Sequence[int] | None = None):
        if convention not in C.CONVENTIONS:
            raise ValueError(f"Unknown convention {convention!r}; expected one of {C.CONVENTIONS}")
        if threads is None:  # every core but one, which drives the framework
            threads = default_threads(1, list(cores) if cores else None)
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be a positive integer, got {threads!r}")
        if not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
        if isinstance(worker_nice, bool) or not isinstance(worker_nice, int):
            raise ValueError(f"worker_nice must be an integer nice value, got {worker_nice!r}")
        self.backend, self.convention, self.pin_moments, self.tc_code = backend, convention, pin_moments, int(tc_code)
        self.chunk = -(-chunk_size // NORM_BLOCK) * NORM_BLOCK
        self._slots: list[_Slot] = []
        self.errors = errors if errors is not None else StickyError()
        self._stats = _Stats()
        self._weights_in_grad_stage = bool(getattr(backend, "weights_in_grad_stage", False))
        self.threads = threads
        self.closed = self._forked = False
        self._unwaited = False  # updates queued since the last wait_step
        self._pool = _WorkerPool(threads, worker_nice, cores)
        self._finalizer = weakref.finalize(self, self._pool.shutdown)  # holds the pool, not self
        _LIVE.add(self)

    def _check_open(self) -> None:
        if self._forked:
            raise RuntimeError(_FORKED)
        if self.closed:
            raise RuntimeError("TrainStream engine is closed")

    def _slot(self, sid: int) -> _Slot:
        if not isinstance(sid, (int, np.integer)) or not 0 <= sid < len(self._slots):
            raise IndexError(f"TrainStream engine: no parameter slot {sid!r}")
        return self._slots[sid]

    def _alloc(self, numel: int, dtype: str, pinned: bool, what: str, tally: list[int]) -> HostBuffer:
        """A backend buffer; adds its bytes to ``tally`` (``[pinned, pageable]``)."""
        buf = self.backend.host_empty(numel, dtype, pinned=pinned, what=what)
        nbytes, size = numel * _ITEMSIZE[dtype], getattr(self.backend, "pinned_size", None)
        tally[0 if buf.pinned else 1] += size(nbytes) if buf.pinned and size is not None else nbytes
        return buf

    def add_param(self, param: Any, numel: int, dtype: str, platform: str) -> int:
        """Register a flat parameter; returns its slot id. Copies its value to the master."""
        self._check_open()
        if dtype not in _KIND:
            raise TypeError(f"TrainStream supports float32, float16 and bfloat16 parameters, got {dtype}")
        if platform not in C.PLATFORMS:
            raise ValueError(f"Unknown platform {platform!r}; expected one of {C.PLATFORMS}")
        numel = int(numel)
        tally = [0, 0]  # counted once all are allocated (a failure drops them)
        master = self._alloc(numel, "float32", dtype == "float32", "adamw.master_fp32", tally)
        self.backend.param_to_host_f32(param, master.array)
        m = self._alloc(numel, "float32", self.pin_moments, "adamw.exp_avg", tally)
        v = self._alloc(numel, "float32", self.pin_moments, "adamw.exp_avg_sq", tally)
        m.array[:] = v.array[:] = 0
        grad = self._alloc(numel, dtype, True, "grad.staging", tally)
        stage = (None if dtype == "float32" else grad if self._weights_in_grad_stage
                 else self._alloc(numel, dtype, True, "param.staging", tally))
        self._slots.append(_Slot(len(self._slots), param, numel, dtype, platform, master, m, v, grad, stage,
                                 nbytes=(tally[0], tally[1])))
        return len(self._slots) - 1

    def truncate(self, n: int) -> None:
        """Drop the slots registered after the first ``n`` (a failed registration)."""
        for s in self._slots[n:]:
            self._wait_idle(s)
        del self._slots[n:]

    def release(self, sid: int) -> None:
        """Free slot ``sid``'s buffers once its queued work has run; the id stays taken, by an empty slot."""
        self._check_open()
        s = self._slot(sid)
        self._settle(s)
        s.free()

    def get_step(self, sid: int) -> int:
        return self._slot(sid).step

    def has_grad(self, sid: int) -> bool:
        return self._slot(sid).staged

    def _submit(self, numel: int, priority: float, landed: Any, body: Callable[[int, int, int], None],
                finalize: Callable[[], None] | None, record: Callable[[BaseException], None],
                done: Callable[[], None]) -> None:
        """Queue one batch: ``body(chunk, begin, end)`` over the chunks of ``numel`` elements. The last
        chunk to finish calls ``finalize()`` if no chunk raised, then ``done()``; every exception goes to
        ``record``. ``landed``: the copy the body waits for (its ``query()`` feeds :class:`_WorkQueue`)."""
        nchunks = max(1, -(-numel // self.chunk))
        finished = itertools.count(1)  # next() is atomic: no lock between the workers
        failed: list[BaseException] = []
        query = getattr(landed, "query", None)

        def job(c: int, b: int, e: int) -> None:
            try:
                body(c, b, e)
            except BaseException as exc:  # noqa: BLE001 - recorded, raised later
                failed.append(exc)
                record(exc)
            if next(finished) == nchunks:  # the batch's last chunk to finish
                try:
                    if finalize is not None and not failed:
                        finalize()
                except BaseException as exc:  # noqa: BLE001
                    record(exc)
                finally:
                    done()

        jobs = [(lambda c=c, b=c * self.chunk, e=min(numel, (c + 1) * self.chunk): job(c, b, e))
                for c in range(nchunks)]
        self._pool.put_many(jobs, priority, _landed(query) if query is not None else None)

    def _run_batch(self, s: _Slot, body: Callable[[int, int, int], None],
                   finalize: Callable[[], None] | None = None, landed: Any = None) -> None:
        """Queue a batch of slot ``s`` (:meth:`_submit`; errors sticky), after its batch in flight if any."""
        with s.cond:
            s.inflight += 1
            if s.inflight > 1:  # a batch of this slot is queued or running: run after it
                s.chain.append((body, finalize, landed))
                return
        try:
            self._submit_batch(s, body, finalize, landed)
        except BaseException:
            with s.cond:  # never queued: waiters must not wait for it
                s.inflight -= 1
                s.cond.notify_all()
            raise

    def _submit_batch(self, s: _Slot, body, finalize, landed) -> None:
        def done() -> None:  # then submit the slot's next chained batch, if any
            with s.cond:
                s.grad_keep = None  # its copy has landed (or failed)
                s.inflight -= 1
                nxt = s.chain.popleft() if s.chain else None
                s.cond.notify_all()
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

        self._submit(s.numel, s.id, landed, body, finalize, self.errors.record, done)

    def _wait_idle(self, s: _Slot) -> None:
        if self._forked:  # before the lock: a worker of the parent may have held it
            raise RuntimeError(_FORKED)
        with s.cond:
            while s.inflight:
                s.cond.wait()

    def _settle(self, s: _Slot) -> None:
        """Wait for the slot's batches and its last upload."""
        self._wait_idle(s)
        if s.ready is not None:
            s.ready.synchronize()

    def offload_grad(self, sid: int, grad: Any, grad_dtype: str, update: C.AdamWHyperParams | None = None) -> None:
        """Stage the gradient of slot ``sid`` (a device tensor of ``grad_dtype``), replacing the one
        staged before; with ``update`` (the eager path) queue its update right behind the copy."""
        self._check_open()
        self.errors.check()
        s = self._slot(sid)
        if grad_dtype != s.dtype:
            raise TypeError(f"gradient of parameter slot {sid} has dtype {grad_dtype}, expected {s.dtype}")
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
        if update is not None:  # eager: the update follows the copy in each chunk's order
            self._stats.add("eager_updates", 1)
            self._enqueue_update(s, update, np.float32(1.0), after)

    def discard_grads(self) -> None:
        """Forget gradients offloaded since the last step (``zero_grad``)."""
        self._check_open()
        for s in self._slots:
            if s.staged:
                self._wait_idle(s)
                s.staged, s.grad_keep = False, None
        self.errors.check()

    def _enqueue_update(self, s: _Slot, hp: C.AdamWHyperParams, clip: np.float32, after: Any) -> None:
        s.step += 1
        scalars = C.step_scalars(hp, s.step, self.convention, s.platform, clip)
        variant = C.variant_id(self.convention, s.platform)
        p, m, v, g, gkind = s.master.array, s.exp_avg.array, s.exp_avg_sq.array, s.grad_stage.array, _KIND[s.dtype]
        out, okind = (None, 0) if s.param_stage is None else (s.param_stage.array, gkind)
        upload_src = s.master if s.param_stage is None else s.param_stage
        landed, prev_ready, nbytes, tc_code = s.landed, s.ready, s.numel * _ITEMSIZE[s.dtype], self.tc_code

        def body(c: int, b: int, e: int) -> None:
            if prev_ready is not None:  # the previous upload may still read master/stage
                prev_ready.synchronize()
            if landed is not None:  # the gradient copy must have landed in staging
                landed.synchronize()
            t = time.perf_counter()
            K.adamw_chunk(variant, p, m, v, g, gkind, out, okind, b, e, scalars, tc_code)
            self._stats.add("update_s", time.perf_counter() - t)

        # Not after a failure: a failed chunk's staging range is unwritten, so the old weights stay.
        def finalize() -> None:
            s.ready = self.backend.copy_to_device(s.param, upload_src, after)
            self._stats.add("param_bytes", nbytes)
            self._stats.last_finalize = time.perf_counter()

        s.staged = False
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
             check_errors: bool = True) -> None:
        """Queue the update of every slot in ``updates`` that holds a gradient (an eagerly updated
        slot holds none). ``coefs``: per slot, the contract's ``c`` multiplying its staged gradient
        (1.0 where absent). ``check_errors=False``: an error since the caller's check raises at the next call."""
        self._check_open()
        if check_errors:
            self.errors.check()
        self._stats.add("steps", 1)
        self._stats.step_start = time.perf_counter()
        coefs = coefs or {}
        for sid, hp in updates:
            s = self._slot(sid)
            if s.staged:
                self._enqueue_update(s, hp, np.float32(coefs.get(sid, 1.0)), self.backend.record_compute(s.param))

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

    def _run_external(self, batches: list, what: str) -> None:
        """Run ``batches`` (``(landed, body, numel, finished)``: :meth:`_submit`'s, priority their
        index) on the workers; wait for all and raise the first failure (not sticky: no slot is touched)."""
        self._check_open()
        self.errors.check()
        errors: list[BaseException] = []  # list.append is atomic
        done, queued = threading.Semaphore(0), 0
        for k, (landed, body, numel, finished) in enumerate(batches):
            try:
                self._submit(numel, k, landed, body, finished, errors.append, done.release)
            except RuntimeError as exc:  # the pool has stopped: wait only for what it took
                errors.append(exc)
                break
            queued += 1
        for _ in range(queued):
            done.acquire()
        if errors:
            exc = errors[0]
            raise WorkerError(f"TrainStream {what} failed in a worker: {type(exc).__name__}: {exc}") from exc

    def update_external(self, items: Sequence[ExternalUpdate], platform: str) -> None:
        """The AdamW update of each :class:`ExternalUpdate` in this placement's convention on
        ``platform`` (``"cpu"``/``"cuda"``: whose arithmetic to reproduce), on the workers; blocks
        until every item and its ``finished`` have run, raises :class:`WorkerError` on a failure.
        No slot is involved: the caller keeps the state and supplies each update's scalars."""
        variant = C.variant_id(self.convention, platform)
        tc_code, stats = self.tc_code, self._stats
        batches = []
        for k, it in enumerate(items):
            if it.gdtype not in _KIND:
                raise TypeError(f"update_external: gradient dtype {it.gdtype!r} is not float32, float16 or bfloat16")
            numel = int(it.m.size)
            for name, a in (("p", it.p), ("v", it.v)):
                if a.size != numel:
                    raise ValueError(f"update_external: item {k}: {name} has {a.size} elements, m has {numel}")
            out, okind = None, K.KIND_F32
            if it.out_kind is not None and it.out is not None:
                if it.out_kind not in _OUT_KIND:
                    raise ValueError(f"update_external: unknown out_kind {it.out_kind!r}")
                out, okind = it.out, _OUT_KIND[it.out_kind]

            def body(c, b, e, it=it, gkind=_KIND[it.gdtype], out=out, okind=okind):
                if it.landed is not None:  # g, p and scalars may still be in flight
                    it.landed.synchronize()
                t = time.perf_counter()
                K.adamw_chunk(variant, it.p, it.m, it.v, it.g, gkind, out, okind, b, e, it.scalars, tc_code)
                stats.add("update_s", time.perf_counter() - t)

            batches.append((it.landed, body, numel, it.finished))
        self._stats.add("steps", 1)
        self._run_external(batches, "update_external")

    def sumsq_external(self, grads: Sequence[tuple[np.ndarray, str, Any]]) -> float:
        """Float64 sum of squares of ``(gradient, dtype, landed event or None)`` buffers the caller
        owns, from partials over blocks of :data:`NORM_BLOCK` elements summed in item, then block
        order (independent of threads and chunking); blocks until done."""
        partials, batches = [], []
        for g, gdtype, landed in grads:
            if gdtype not in _KIND:
                raise TypeError(f"sumsq_external: gradient dtype {gdtype!r} is not float32, float16 or bfloat16")
            out = np.zeros(-(-int(g.size) // NORM_BLOCK), np.float64)
            partials.append(out)

            def body(c, b, e, g=g, kind=_KIND[gdtype], out=out, landed=landed):
                if landed is not None:
                    landed.synchronize()
                K.sumsq_blocks(g, kind, b, e, NORM_BLOCK, out[b // NORM_BLOCK:])

            batches.append((landed, body, int(g.size), None))
        self._run_external(batches, "sumsq_external")
        total = 0.0
        for out in partials:
            for x in out.tolist():  # sequential: sum() of floats compensates (Python >= 3.12)
                total += x
        return total

    def state(self, sid: int, copy: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """``(master_fp32, exp_avg, exp_avg_sq, step)`` of slot ``sid`` once its queued work has run:
        copies, or with ``copy=False`` the buffers themselves (changing them changes the state)."""
        self._check_open()
        s = self._slot(sid)
        self._wait_idle(s)
        self.errors.check()
        bufs = (s.master.array, s.exp_avg.array, s.exp_avg_sq.array)
        return (*(b.copy() if copy else b for b in bufs), s.step)

    def reload_param(self, sid: int, param: Any = None) -> None:
        """The weights of slot ``sid`` were changed outside the engine (or its parameter replaced by
        ``param``, same size and dtype): read them into the master, keeping an fp16/bf16 element's
        fp32 master where it still rounds to the weight (:func:`trainstream.contract.merge_master`)."""
        self._check_open()
        s = self._slot(sid)
        self._settle(s)
        if param is not None:
            s.param = param
        weights = np.empty(s.numel, np.float32)
        self.backend.param_to_host_f32(s.param, weights)
        C.merge_master(s.master.array, weights, s.dtype)

    def load_state(self, sid: int, exp_avg: np.ndarray, exp_avg_sq: np.ndarray, step: int,
                   master: np.ndarray | None = None) -> None:
        """:meth:`Engine.load_state`, which checks the arguments."""
        self._check_open()
        s = self._slot(sid)
        self._settle(s)
        s.exp_avg.array[:] = np.asarray(exp_avg, np.float32).reshape(-1)
        s.exp_avg_sq.array[:] = np.asarray(exp_avg_sq, np.float32).reshape(-1)
        if master is not None:
            s.master.array[:] = np.asarray(master, np.float32).reshape(-1)
        else:
            self.backend.param_to_host_f32(s.param, s.master.array)
        s.step = int(step)  # a staged gradient stays staged: the caller says whether to update from it

    def stats(self) -> dict[str, float]:
        """Counters of the reference engine (bytes, milliseconds, counts)."""
        st = self._stats
        live = [s for s in self._slots if s.master is not None]  # not released
        last_wall = st.last_finalize - st.step_start if st.last_finalize >= st.step_start else 0.0
        pinned, pageable = (sum(s.nbytes[k] for s in live) for k in (0, 1))
        return {
            "params": float(len(live)), "numel": float(sum(s.numel for s in live)),
            "threads": float(self.threads), "gpu_mode": 0.0, "steps": float(st.steps),
            "eager_updates": float(st.eager_updates), "host_state_bytes": float(pinned + pageable),
            "pinned_state_bytes": float(pinned), "pageable_state_bytes": float(pageable),
            "grad_bytes_offloaded": float(st.grad_bytes), "param_bytes_uploaded": float(st.param_bytes),
            "update_ms_total": st.update_s * 1e3, "ready_stall_ms_total": st.ready_stall_s * 1e3,
            "grad_stall_ms_total": st.grad_stall_s * 1e3, "last_step_wall_ms": last_wall * 1e3,
        }

    def close(self) -> None:
        """Drain the queued work, join the workers and release the host buffers."""
        if self.closed:
            return
        if not self._forked and threading.current_thread() in self._pool._threads:
            # From a worker (e.g. a finalizer run by the garbage collector): let the workers drain and stop.
            self.closed = True
            self._finalizer()
            return
        try:
            for s in self._slots if not self._forked else ():  # a child of os.fork() has no work to wait for
                self._wait_idle(s)
                if s.ready is not None:
                    try:
                        s.ready.synchronize()
                    except Exception:  # noqa: BLE001 - closing regardless
                        pass
        finally:
            self.closed = True
            self._finalizer()  # joins the workers (once; detached in a child of os.fork())
            for s in self._slots:
                s.free()
            self._slots = []
