"""Updates over buffers the caller owns (the JAX adapter's: XLA's buffers), with no slot: the caller keeps the state
and supplies each update's scalars (the contract's vector, one per tensor). Both placements take them, through the
engine (:class:`~trainstream.core._engine.Engine`, also made without a framework backend for them):

* :class:`ExternalUpdate`: flat NumPy views, updated by the host kernels on the host placement's workers
  (``Engine.update_external``; blocks until every item has run);
* :class:`DeviceUpdate`: device addresses, updated by the CUDA kernels that the device placement launches on the
  caller's stream (``Engine.launch_external``; returns once queued), the state staged through its ring.

This module checks the items and turns them into the placements' work. No torch or jax import.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from .. import _host_kernels as K
from .. import contract as C
from ._budget import _ITEMSIZE
from ._pool import WorkerError

__all__ = ["DeviceUpdate", "ExternalUpdate", "HostExternal", "KIND", "CHUNK_ALIGN", "device_groups", "run_batches",
           "update_batches"]

#: The host placement's chunk sizes are multiples of this many elements (whole cache lines and pages per chunk).
CHUNK_ALIGN = 4096

#: The host kernels' codes of the gradient dtypes.
KIND = {"float32": K.KIND_F32, "float16": K.KIND_F16, "bfloat16": K.KIND_BF16}
_OUT_KIND = {"u": K.OUT_U, "float16": K.KIND_F16, "bfloat16": K.KIND_BF16}  # ExternalUpdate.out_kind

#: A batch of the host workers: ``(landed, body(chunk, begin, end), numel, finished)``.
Batch = tuple[Any, Callable[[int, int, int], None], int, Callable[[], None] | None]


class ExternalUpdate(NamedTuple):
    """One tensor's AdamW update over flat NumPy views of buffers the caller owns (e.g. XLA's), run by
    :meth:`~trainstream.core._host.HostPlacement.update_external` with :func:`trainstream._host_kernels.adamw_chunk`."""

    p: np.ndarray  # float32 weights or fp32 master (optax's 16-bit state: the leaf's uint16 bits), updated in place
    #                (read-only with out_kind "u")
    m: np.ndarray  # the moments, in place: float32, or the uint16 bits of optax's 16-bit state
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


def update_batches(items: Iterable[ExternalUpdate], variant: int, tc_code: int, stats: Any) -> Iterable[Batch]:
    """The workers' batch of each item (``stats.add("update_s", seconds)`` per chunk). A sequence: every item is
    checked before any batch is made (``TypeError``/``ValueError``); an iterator (items made while the first run, as
    a staging ring frees its buffers): each item as it comes."""
    if isinstance(items, Iterator):
        return (_batch(k, it, variant, tc_code, stats) for k, it in enumerate(items))
    return [_batch(k, it, variant, tc_code, stats) for k, it in enumerate(items)]


def _batch(k: int, it: ExternalUpdate, variant: int, tc_code: int, stats: Any) -> Batch:
    """Item ``k``'s batch, checked."""
    if it.gdtype not in KIND:
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

    def body(c, b, e, gkind=KIND[it.gdtype]):
        if it.landed is not None:  # g, p and scalars may still be in flight
            it.landed.synchronize()
        t = time.perf_counter()
        K.adamw_chunk(variant, it.p, it.m, it.v, it.g, gkind, out, okind, b, e, it.scalars, tc_code)
        stats.add("update_s", time.perf_counter() - t)

    return it.landed, body, numel, it.finished


def run_batches(submit: Callable, batches: Iterable[Batch], what: str,
                released: Callable[[int], None] | None = None) -> None:
    """Run ``batches`` on the host workers through ``submit`` (the host placement's, priority their index); wait
    for all and raise the first failure as :class:`WorkerError` (not sticky: no slot is touched). ``released(k)``:
    called once queued batch ``k`` has finished, failed or not (after its ``finished``), from the worker that finished
    it; an iterator's failure is raised once the batches queued before it have finished."""
    errors: list[BaseException] = []  # list.append is atomic
    done, queued, failure = threading.Semaphore(0), 0, None

    def end(k: int) -> None:
        try:
            if released is not None:
                released(k)
        finally:
            done.release()

    try:
        for k, (landed, body, numel, finished) in enumerate(batches):
            try:
                submit(numel, k, landed, body, finished, errors.append, functools.partial(end, k))
            except RuntimeError as exc:  # the pool has stopped: wait only for what it took
                errors.append(exc)
                break
            queued += 1
    except BaseException as exc:  # noqa: BLE001 - an iterator of items failed: what it queued finishes first
        failure = exc
    for _ in range(queued):
        done.acquire()
    if failure is not None:
        raise failure
    if errors:
        exc = errors[0]
        raise WorkerError(f"TrainStream {what} failed in a worker: {type(exc).__name__}: {exc}") from exc


class HostExternal:
    """The external-update methods of :class:`~trainstream.core._host.HostPlacement` (its pool, convention and
    counters)."""

    def _run_external(self, batches: Iterable[Batch], what: str,
                      released: Callable[[int], None] | None = None) -> None:
        """:func:`~trainstream.core._external.run_batches` through :meth:`_submit`."""
        self._check_open()
        self.errors.check()
        run_batches(self._submit, batches, what, released)

    def update_external(self, items: Iterable[ExternalUpdate], platform: str,
                        released: Callable[[int], None] | None = None) -> None:
        """The AdamW update of each :class:`~trainstream.core._external.ExternalUpdate` in this placement's
        convention on ``platform`` (``"cpu"``/``"cuda"``: whose arithmetic to reproduce), on the workers; blocks
        until every item and its ``finished`` have run, raises :class:`WorkerError` on a failure. ``items``: a
        sequence, or an iterator consumed as they run (a staging ring's pieces, :mod:`~trainstream.core._hostring`;
        ``released(k)`` once queued item ``k`` is done, failed or not). No slot is involved: the caller keeps the
        state and supplies each update's scalars."""
        batches = update_batches(items, C.variant_id(self.convention, platform), self.tc_code, self._stats)
        self._stats.add("steps", 1)
        self._run_external(batches, "update_external", released)


class DeviceUpdate(NamedTuple):
    """One tensor's AdamW update by a CUDA kernel over buffers the caller owns (e.g. XLA's), launched by
    :meth:`~trainstream.core._device.DevicePlacement.launch_external`. Every buffer is a device address; the state
    lives in pinned host memory (its mapped address, which UVA makes its host address too)."""

    weights: int  # the weights (dtype), updated in place; with ``u``: read only
    grad: int  # the gradient (gdtype), in GPU memory
    m: int  # the moments in pinned host memory (mdtype, vdtype), updated in place
    v: int
    master: int  # the float32 master of fp16/bf16 weights with float32 state (pinned host memory, in place); else 0
    u: int  # 0; or (optax, no master) a buffer in GPU memory for the update u before the lr (update_dtype's)
    numel: int
    dtype: str  # of the weights
    gdtype: str  # of the gradient
    scalars: int  # the device address of its float32[N_SCALARS] scalars
    mdtype: str = "float32"  # mu's: float32, or optax's own state (trainstream._device_kernels.OPTAX_STATES)
    vdtype: str = "float32"  # nu's


def device_groups(items: Sequence[DeviceUpdate]) -> dict[tuple, list]:
    """The items grouped by launch kind, in first-seen order: ``("w", dtype, gdtype, state)`` (the new weights) or
    ``("u", dtype, gdtype, state)`` (``u``), ``state`` ``(mdtype, vdtype)`` or None (float32); per item the
    :class:`~trainstream.core._ring.StagingRing` entry ``(state host addresses and bytes per element (m, v[, master]),
    numel, item(lo, n, state device addresses) -> the kernel's item, None)``."""
    groups: dict[tuple, list] = {}
    for k, it in enumerate(items):
        if any(d not in _ITEMSIZE for d in (it.dtype, it.gdtype, it.mdtype, it.vdtype)):
            raise TypeError(f"launch_external: item {k} has dtypes {it.dtype}/{it.gdtype}, state {it.mdtype}/"
                            f"{it.vdtype}; the kernels take float32, float16 and bfloat16")
        own = (it.mdtype, it.vdtype) != ("float32", "float32")  # optax's own state: no master
        if bool(it.master) != (it.dtype != "float32" and not own) or (it.u and it.master):
            raise ValueError(f"launch_external: item {k}: {it.dtype} weights with {it.mdtype}/{it.vdtype} state take "
                             f"{'a master and no u' if it.dtype != 'float32' and not own else 'no master'}")
        st = (it.mdtype, it.vdtype) if own else None
        key = ("u" if it.u else "w", it.dtype, it.gdtype, st)
        state = ((it.m, _ITEMSIZE[it.mdtype]), (it.v, _ITEMSIZE[it.vdtype])) + ((it.master, 4),) * bool(it.master)
        ui = _ITEMSIZE[it.dtype if st == (it.dtype, it.dtype) else "float32"]  # u: optax's update dtype

        def item(lo, n, d, it=it, pi=_ITEMSIZE[it.dtype], gi=_ITEMSIZE[it.gdtype], ui=ui):
            """The kernel item of elements lo:lo+n, the state at ``d`` (m, v[, master])."""
            third = d[2] if it.master else (it.u + ui * lo if it.u else 0)
            return (it.weights + pi * lo, it.grad + gi * lo, third, d[0], d[1], n, it.scalars)

        groups.setdefault(key, []).append((state, int(it.numel), item, None))
    return groups
